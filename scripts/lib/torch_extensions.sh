# Sourced by the scripts that run DeepSpeed on this machine (test.sh, quickstart.sh,
# gpu_check.sh --cpu-dry-run). own_torch_extensions PYTHON: unless TORCH_EXTENSIONS_DIR is set,
# point torch's JIT builds (DeepSpeed's CPU ops: deepspeed_shm_comm at every start, cpu_adam,
# fused_adam) at a folder of that Python environment's own. In torch's one shared default
# (~/.cache/torch_extensions) the build flags name each environment's site-packages, so two
# checkouts (two clones' suites side by side, a helper's venv beside the main one) rebuild the
# op for each other at every start, half a minute to a minute each, serialized on its lock.
own_torch_extensions() {
    local key
    key="$(printf '%s' "$1" | sha256sum | cut -c1-12)"
    export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/gpt2-megatron/torch_extensions-$key}"
}
