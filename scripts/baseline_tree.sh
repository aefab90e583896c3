#!/usr/bin/env bash
# Put an earlier commit's package where the GPU host can import it beside today's:
#   bash scripts/baseline_tree.sh COMMIT [DEST]
# writes DEST (default .baseline/ at the repository root, git-ignored through .git/info/exclude
# as ../shared/device/stage does for .gpu/): the commit's moe_jax/ with its kernels/ and interop/
# moved under it (the layout the editable install maps), importable from inside DEST, and
# DEST/COMMIT naming it. Then, on the GPU host (carry [".gpu", ".baseline"]):
#   bash scripts/gpu_check.sh baseline
set -euo pipefail
commit="${1:?usage: bash scripts/baseline_tree.sh COMMIT [DEST]}"
root="$(git rev-parse --show-toplevel)"
rev="$(git -C "$root" rev-parse --verify --quiet --short "$commit^{commit}")" \
  || { echo "baseline_tree: $commit is not a commit of $root" >&2; exit 2; }
dest="${2:-$root/.baseline}"
if [ -z "${2:-}" ]; then
  grep -qxF '/.baseline/' "$root/.git/info/exclude" 2>/dev/null \
    || echo '/.baseline/' >> "$root/.git/info/exclude"
fi
rm -rf "$dest"
mkdir -p "$dest"
git -C "$root" archive "$rev" moe_jax kernels interop | tar -x -C "$dest"
mv "$dest/kernels" "$dest/moe_jax/kernels"
mv "$dest/interop" "$dest/moe_jax/interop"
echo "$rev" > "$dest/COMMIT"
echo "baseline $rev in $dest ($(du -sh "$dest" | cut -f1)); carry [\".gpu\", \".baseline\"]"
