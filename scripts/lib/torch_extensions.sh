# Sourced by the scripts that run DeepSpeed on this machine (test.sh, gpu_check.sh
# --cpu-dry-run). own_torch_extensions PYTHON makes torch's JIT builds (DeepSpeed's CPU ops:
# deepspeed_shm_comm at every start, cpu_adam, fused_adam) build once per environment:
# - TORCH_EXTENSIONS_DIR (unless set): a folder of that Python environment's own. In torch's one
#   shared default (~/.cache/torch_extensions) the build flags name each environment's
#   site-packages, so two checkouts (two clones' suites side by side, a helper's venv beside
#   the main one) rebuild the op for each other at every start.
# - that environment's bin folder first on PATH, as an activated venv has it: torch runs the
#   `ninja` it finds there. The pip ninja (1.13) and a system one (Debian's 1.11) hash commands
#   differently in .ninja_log, so processes started with and without the venv's bin on PATH
#   took each other's build for a changed one and rebuilt it (~20 s each, 5 times a suite).
own_torch_extensions() {
    local key bin
    key="$(printf '%s' "$1" | sha256sum | cut -c1-12)"
    export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/gpt2-megatron/torch_extensions-$key}"
    bin="$(dirname "$1")"
    case ":$PATH:" in
        ":$bin:"*) ;;
        *) export PATH="$bin:$PATH" ;;
    esac
}
