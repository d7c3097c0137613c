"""End to end: the toy target and drafter decoding through the tree ops, lossless and measured."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.serving import ServerThread

from ddtree.clients import Client, EmbeddedClient, demo
from ddtree.clients.speculative import KernelOps, SpeculativeDecoder, TreeOps
from ddtree.clients.toy import load_pair
from ddtree.clients.toy.data import held_out_prompts
from ddtree.service.config import ServiceConfig

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.set_num_threads(2)
    return load_pair("cpu")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [list(p) for p in held_out_prompts(3)]


@pytest.fixture(scope="module")
def greedy_reference(models, prompts) -> list[list[int]]:
    target, drafter = models
    decoder = SpeculativeDecoder(target, drafter, KernelOps())
    return decoder.generate(prompts, NEW_TOKENS, method="autoregressive").tokens


@pytest.fixture(scope="module", params=["direct", "embedded", "remote-tcp", "remote-unix"])
def ops(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TreeOps]:
    """Tree ops: in-process kernels, an embedded engine, or a real server over TCP / a socket."""
    if request.param == "direct":
        yield KernelOps()
    elif request.param == "embedded":
        with EmbeddedClient(device="cpu") as embedded:
            yield embedded
    else:
        folder = tmp_path_factory.mktemp("ddtree")
        listen = "127.0.0.1:0" if request.param == "remote-tcp" else f"unix:{folder}/ddtree.sock"
        server = ServerThread(ServiceConfig(listen=(listen,), device="cpu"))
        server.start()
        try:
            with Client(server.addresses[0], default_timeout_s=60.0) as client:
                yield client
        finally:
            server.stop()


@pytest.mark.parametrize(
    ("method", "budget"),
    [("chain", 0), ("ddtree", 1), ("ddtree", 7), ("ddtree", 64)],
    ids=["chain", "ddtree-1", "ddtree-7", "ddtree-64"],
)
def test_greedy_speculative_equals_greedy_autoregressive(
    models, prompts, greedy_reference, ops, method, budget
):
    target, drafter = models
    decoder = SpeculativeDecoder(target, drafter, ops)
    result = decoder.generate(prompts, NEW_TOKENS, method=method, budget=budget)
    for request, (got, want) in enumerate(zip(result.tokens, greedy_reference, strict=True)):
        assert got == want, f"request {request}: first difference at token " + str(
            next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        )


def test_ragged_batch_matches_single_requests(models, prompts):
    """Requests of different prompt lengths in one batch decode as they would alone."""
    target, drafter = models
    decoder = SpeculativeDecoder(target, drafter, KernelOps())
    ragged = [prompts[0][40:], prompts[1], prompts[2][90:]]
    batched = decoder.generate(ragged, 32, method="ddtree", budget=16).tokens
    for prompt, got in zip(ragged, batched, strict=True):
        alone = decoder.generate([prompt], 32, method="autoregressive").tokens[0]
        assert got == alone


def test_ddtree_accepts_more_than_chain_at_budget_64(models, prompts):
    target, drafter = models
    decoder = SpeculativeDecoder(target, drafter, KernelOps())
    chain = decoder.generate(prompts, 96, method="chain").stats
    tree = decoder.generate(prompts, 96, method="ddtree", budget=64).stats
    assert tree.mean_acceptance_length > chain.mean_acceptance_length
    # The live budget curve is nondecreasing and ends at the run's own mean.
    curve = list(tree.budget_curve.values())
    assert curve == sorted(curve)
    assert curve[-1] == pytest.approx(tree.mean_acceptance_length)


def _chi2_critical(dof: int, z: float) -> float:
    """Upper quantile of chi-square(dof) by the Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.slow
def test_sampled_first_tokens_follow_the_target(models, prompts):
    """At temperature 1 the first two emitted tokens are distributed as the target samples them.

    ``draws`` copies of one prompt decode one DDTree step each (the sampling noise differs per
    request, and per call through the seed). The joint counts of the first two emitted tokens
    are compared with the target's exact probabilities ``p(x1) * p(x2 | x1)`` by a chi-square
    test; cells expected below 5 are pooled. False-alarm rate: 0.1% (z = 3.09), so a correct
    loop fails this test about once in a thousand seeds; the seeds here are fixed.
    """
    target, drafter = models
    decoder = SpeculativeDecoder(target, drafter, KernelOps())
    # The prompt cut (from the held-out prompts) where the target is least sure of what
    # comes next, so that many cells have enough expected counts.
    cuts = [p[:end] for p in prompts for end in range(40, len(p) + 1, 4)]
    with torch.no_grad():
        last = torch.stack([target(torch.tensor([c]))[0][0, -1] for c in cuts])  # [cuts, vocab]
    entropy = -(torch.softmax(last, -1) * torch.log_softmax(last, -1)).sum(-1)  # [cuts]
    prompt = cuts[int(entropy.argmax())]
    copies, calls = 200, 5
    counts: Counter[tuple[int, int]] = Counter()
    for call in range(calls):
        result = decoder.generate(
            [prompt] * copies, 2, method="ddtree", budget=16, temperature=1.0, seed=1000 + call
        )
        counts.update((tokens[0], tokens[1]) for tokens in result.tokens)
    draws = copies * calls
    with torch.no_grad():
        first_probs = torch.softmax(target(torch.tensor([prompt]))[0][0, -1].double(), -1)
        seen_first = sorted(
            {x1 for x1, _ in counts} | set(torch.nonzero(first_probs * draws >= 5)[:, 0].tolist())
        )
        second_logits = target(torch.tensor([prompt + [x1] for x1 in seen_first]))[0][
            :, -1
        ].double()
    expected: dict[tuple[int, int] | None, float] = {}
    observed: dict[tuple[int, int] | None, int] = {}
    for row, x1 in enumerate(seen_first):
        second_probs = torch.softmax(second_logits[row], -1)
        for x2, p in enumerate((first_probs[x1] * second_probs).tolist()):
            cell = (x1, x2) if p * draws >= 5 else None
            expected[cell] = expected.get(cell, 0.0) + p * draws
            observed[cell] = observed.get(cell, 0) + counts.get((x1, x2), 0)
    # Whatever mass the listed first tokens miss also goes to the pooled cell.
    expected[None] = expected.get(None, 0.0) + draws - sum(expected.values())
    observed[None] = observed.get(None, 0) + draws - sum(observed.values())
    statistic = sum((observed[c] - e) ** 2 / e for c, e in expected.items() if e > 0)
    dof = len(expected) - 1
    assert dof >= 5, "too few cells for a meaningful test"
    assert statistic < _chi2_critical(dof, 3.0902), (statistic, dof, _chi2_critical(dof, 3.0902))


def test_docs_demo_example_runs():
    """The Python example of docs/demo.md runs as written."""
    text = (Path(__file__).parents[2] / "docs" / "demo.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(example, "docs/demo.md", "exec"), namespace)
    stats = namespace["result"].stats  # type: ignore[attr-defined]
    assert stats.mean_acceptance_length > 1.0


@pytest.mark.parametrize("where", [["--direct"], []], ids=["direct", "local-server"])
def test_demo_reports_lossless(where, capsys):
    """``ddtree demo`` (in process, and with the ``ddtree serve`` it starts) exits 0, lossless."""
    status = demo.main([*where, "--max-new-tokens", "16", "--prompts", "2", "--budgets", "8"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "lossless: every speculative greedy output is identical" in printed
    assert printed.count("identical\n") == 3  # autoregressive, chain, ddtree 8
    if not where:
        assert "ddtree_accepted_tokens_total" in printed
