#!/usr/bin/env bash
# Apply megatron-mesh's patch to a Megatron-LM checkout (tag core_v0.16.1) with `git apply`.
#
#   scripts/apply_megatron_patch.sh [--check | --revert] <Megatron-LM checkout>
#
#   (default)  apply the patch; nothing to do when it is already applied
#   --check    only report whether it applies (or is already applied); change nothing
#   --revert   take the patch out again
#
# Exit status: 0 done (or would apply / already applied), 1 the patch does not apply,
# 2 usage error or not a Megatron-LM checkout.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PATCH=${MEGATRON_MESH_PATCH:-$HERE/../patches/megatron_lm_core_v0.16.1.patch}
TARGET_TAG=core_v0.16.1

usage() { sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

mode=apply
case ${1:-} in
    --check) mode=check; shift ;;
    --revert) mode=revert; shift ;;
    -h|--help|"") usage ;;
esac
[[ $# -eq 1 ]] || usage
DIR=$1

command -v git >/dev/null || { echo "error: git is needed (git apply)" >&2; exit 2; }
[[ -f $PATCH ]] || { echo "error: patch not found: $PATCH" >&2; exit 2; }
PATCH=$(cd "$(dirname "$PATCH")" && pwd)/$(basename "$PATCH")
for f in pretrain_gpt.py gpt_builders.py megatron/training/arguments.py megatron/training/initialize.py; do
    if [[ ! -f $DIR/$f ]]; then
        echo "error: $DIR is not a Megatron-LM checkout with gpt_builders.py ($f missing);" \
             "the patch is for tag $TARGET_TAG" >&2
        exit 2
    fi
done
DIR=$(cd "$DIR" && pwd)

# Paths in the patch are relative to the checkout. When the checkout sits inside a git
# work tree below its top, git apply takes paths from the top: prefix them.
prefix=$(git -C "$DIR" rev-parse --show-prefix 2>/dev/null || true)
git_apply() { (cd "$DIR" && git apply ${prefix:+--directory="$prefix"} "$@" "$PATCH"); }

version=$(sed -n "s/^MAJOR = \(.*\)/\1/p; s/^MINOR = \(.*\)/.\1/p; s/^PATCH = \(.*\)/.\1/p" \
          "$DIR/megatron/core/package_info.py" 2>/dev/null | tr -d '\n' || true)

if git_apply --reverse --check 2>/dev/null; then
    applied=yes
else
    applied=no
fi

case $mode in
    revert)
        if [[ $applied == no ]]; then
            echo "megatron-mesh patch is not applied in $DIR: nothing to revert"
            exit 0
        fi
        git_apply --reverse
        echo "megatron-mesh patch reverted in $DIR"
        exit 0 ;;
esac

if [[ $applied == yes ]]; then
    echo "megatron-mesh patch is already applied in $DIR"
    exit 0
fi

if ! errors=$(git_apply --check 2>&1); then
    cat >&2 <<MSG
error: the megatron-mesh patch does not apply to $DIR
  checkout: megatron-core ${version:-unknown version}; the patch is for tag $TARGET_TAG
  patch:    $PATCH
git apply says:
$(sed 's/^/  /' <<<"$errors")
Use a checkout of $TARGET_TAG (git checkout $TARGET_TAG), or run Megatron-LM unpatched with
examples/megatron_lm_pretrain_mesh.py (see docs/megatron_lm.md).
MSG
    exit 1
fi

if [[ $mode == check ]]; then
    echo "megatron-mesh patch applies cleanly to $DIR (megatron-core ${version:-unknown version})"
    exit 0
fi

git_apply --verbose 2>&1 | sed -n 's/^Applied patch \(.*\) cleanly\./  patched \1/p'
echo "megatron-mesh patch applied to $DIR: pretrain_gpt.py now takes" \
     "--context-parallel-algo mesh --mesh-shape RxC (megatron_mesh must be importable)"
