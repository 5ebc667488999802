#!/usr/bin/env bash
# Prints the Megatron-LM checkout of tag $1 (e.g. core_v0.16.1) for tests/system/test_megatron_lm.py,
# unpacking it once into .megatron-lm/ (ignored by git) from Megatron-LM-<tag>.tar.gz in
# MEGATRON_LM_SOURCES (default: shared/megatron-lm beside this checkout); prints nothing when
# that archive is absent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tag=$1
sources=${MEGATRON_LM_SOURCES:-$(dirname "$PWD")/shared/megatron-lm}
dir=.megatron-lm/Megatron-LM-$tag
if [[ ! -f $dir/pretrain_gpt.py && -f $sources/Megatron-LM-$tag.tar.gz ]]; then
  rm -rf "$dir.part" && mkdir -p "$dir.part"  # unpack aside: a cut-off run leaves no half checkout
  tar -xzf "$sources/Megatron-LM-$tag.tar.gz" -C "$dir.part"
  rm -rf "$dir" && mv "$dir.part/Megatron-LM-$tag" "$dir" && rmdir "$dir.part"
fi
if [[ -f $dir/pretrain_gpt.py ]]; then
  echo "$PWD/$dir"
fi
