"""Hugging Face GPT-2 <-> our GPT-2: weight names and layouts, config.json, and the directory
`save_pretrained` writes (safetensors, optionally sharded, or pytorch_model.bin).

Layout differences handled both ways:
- HF's Conv1D stores weights [in, out]; ours (nn.Linear / the parallel layers) [out, in];
- HF's fused c_attn rows are [(q, k, v), heads, head_dim]; ours [heads, (q, k, v), head_dim];
- HF's vocabulary is the tokenizer's; ours is padded (pad_vocab_size), so rows are trimmed on
  export and padded again on import;
- HF's lm_head is tied to wte and not stored.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
from typing import Any, Dict, List, Optional

import torch

from app.checkpoint import layout
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.model_card import model_card
from app.checkpoint.state import ModelCheckpoint, Progress, describe
from app.model.hf_compat import gpt2_export_blockers
from app.utils.dtypes import torch_dtype

logger = logging.getLogger(__name__)

HF_PREFIX = "transformer."
_NORMS = (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"))
_LINEARS = (("attention.query_key_value", "attn.c_attn"), ("attention.dense", "attn.c_proj"),
            ("mlp.dense_h_to_4h", "mlp.c_fc"), ("mlp.dense_4h_to_h", "mlp.c_proj"))
_IGNORED_HF = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"


class HFConversionError(ValueError):
    """A Hugging Face file or key that cannot be mapped; the message names it."""


def checkpoint_args_blockers(args: argparse.Namespace) -> List[str]:
    """`gpt2_export_blockers` of the model a checkpoint's saved `args` describe (read by
    app.checkpoint.model_args; a field an older checkpoint lacks means GPT-2's choice)."""
    return gpt2_export_blockers(model_config_from_args(args, for_inference=True))


def qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Our QKV rows [heads, (q,k,v), hd] -> HF's [(q,k,v), heads, hd] (weight [3h, ...] or bias)."""
    rows = t.shape[0]
    return t.reshape(heads, 3, rows // (3 * heads), *t.shape[1:]).transpose(0, 1).reshape(
        rows, *t.shape[1:])


def qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's c_attn rows [(q,k,v), heads, hd] -> ours [heads, (q,k,v), hd]; inverse of qkv_to_hf."""
    rows = t.shape[0]
    return t.reshape(3, heads, rows // (3 * heads), *t.shape[1:]).transpose(0, 1).reshape(
        rows, *t.shape[1:])


def to_hf_state(ours: Dict[str, torch.Tensor], num_layers: int, heads: int,
                vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Our full tensors (params or grads, our names) -> HF GPT2LMHeadModel names and layouts.

    `vocab_size` trims the word embeddings to the tokenizer's rows (None keeps them all).
    """
    wte = ours[layout.WORD_EMBEDDINGS]
    out = {"transformer.wte.weight": wte[:vocab_size] if vocab_size else wte,
           "transformer.wpe.weight": ours[layout.POSITION_EMBEDDINGS],
           "transformer.ln_f.weight": ours[layout.FINAL_NORM[0]],
           "transformer.ln_f.bias": ours[layout.FINAL_NORM[1]]}
    for i in range(num_layers):
        h = f"transformer.h.{i}."
        for ours_name, hf_name in _NORMS:
            for kind in ("weight", "bias"):
                out[f"{h}{hf_name}.{kind}"] = ours[layout.layer_param_name(i, f"{ours_name}.{kind}")]
        for ours_name, hf_name in _LINEARS:
            weight = ours[layout.layer_param_name(i, f"{ours_name}.weight")]
            bias = ours[layout.layer_param_name(i, f"{ours_name}.bias")]
            if ours_name == "attention.query_key_value":
                weight, bias = qkv_to_hf(weight, heads), qkv_to_hf(bias, heads)
            out[f"{h}{hf_name}.weight"] = weight.t()
            out[f"{h}{hf_name}.bias"] = bias
    return out


def from_hf_state(hf: Dict[str, torch.Tensor], num_layers: int, heads: int
                  ) -> Dict[str, torch.Tensor]:
    """HF GPT-2 tensors (with or without the 'transformer.' prefix) -> our names and layouts.

    The vocabulary keeps HF's rows (pad it afterwards). An unknown key, a missing key or an
    lm_head that is not the tied word embedding raises HFConversionError naming the key.
    """
    state = {}
    for key, value in hf.items():
        if _IGNORED_HF.match(key):
            continue  # attention-mask buffers of old transformers versions
        if key == "lm_head.weight":
            continue  # checked against wte below
        state[key if key.startswith(HF_PREFIX) else HF_PREFIX + key] = value
    ours = {layout.WORD_EMBEDDINGS: _take(state, "transformer.wte.weight"),
            layout.POSITION_EMBEDDINGS: _take(state, "transformer.wpe.weight")}
    head = hf.get("lm_head.weight")
    if head is not None and not torch.equal(head, ours[layout.WORD_EMBEDDINGS]):
        raise HFConversionError("lm_head.weight differs from transformer.wte.weight: untied output "
                                "embeddings cannot be mapped to Megatron's tied GPT-2")
    for i in range(num_layers):
        h = f"transformer.h.{i}."
        for ours_name, hf_name in _NORMS:
            for kind in ("weight", "bias"):
                ours[layout.layer_param_name(i, f"{ours_name}.{kind}")] = _take(
                    state, f"{h}{hf_name}.{kind}")
        for ours_name, hf_name in _LINEARS:
            weight = _take(state, f"{h}{hf_name}.weight").t().contiguous()
            bias = _take(state, f"{h}{hf_name}.bias")
            if ours_name == "attention.query_key_value":
                weight, bias = qkv_from_hf(weight, heads), qkv_from_hf(bias, heads)
            ours[layout.layer_param_name(i, f"{ours_name}.weight")] = weight
            ours[layout.layer_param_name(i, f"{ours_name}.bias")] = bias
    ours[layout.FINAL_NORM[0]] = _take(state, "transformer.ln_f.weight")
    ours[layout.FINAL_NORM[1]] = _take(state, "transformer.ln_f.bias")
    if state:
        raise HFConversionError(f"Hugging Face key {sorted(state)[0]!r} cannot be mapped to GPT-2 "
                                f"with {num_layers} layers (config.json n_layer)")
    return ours


def _take(state: Dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise HFConversionError(f"Hugging Face checkpoint has no {key!r}")
    return state.pop(key)


# ---------------------------------------------------------------------------- config

def hf_config(args: argparse.Namespace, dtype: torch.dtype, eod: Optional[int]) -> Dict:
    """config.json of GPT2LMHeadModel for a model described by Megatron `args`."""
    hidden, ffn = int(args.hidden_size), int(getattr(args, "ffn_hidden_size", 0) or 0)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "activation_function": "gelu_new" if getattr(args, "openai_gelu", False) else "gelu",
        "n_layer": int(args.num_layers), "n_embd": hidden,
        "n_head": int(args.num_attention_heads),
        "n_inner": None if ffn in (0, 4 * hidden) else ffn,
        "n_positions": int(args.max_position_embeddings),
        "n_ctx": int(args.max_position_embeddings),
        "vocab_size": int(getattr(args, "vocab_size", None) or args.padded_vocab_size),
        "layer_norm_epsilon": float(getattr(args, "layernorm_epsilon", 1e-5)),
        "initializer_range": float(getattr(args, "init_method_std", 0.02)),
        "resid_pdrop": float(getattr(args, "hidden_dropout", 0.1)),
        "embd_pdrop": float(getattr(args, "hidden_dropout", 0.1)),
        "attn_pdrop": float(getattr(args, "attention_dropout", 0.1)),
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eod, "eos_token_id": eod,
        "dtype": str(dtype).replace("torch.", ""),
    }


def args_from_hf_config(config: Dict, path: str, make_vocab_size_divisible_by: int = 128
                        ) -> argparse.Namespace:
    """Megatron args (model shape, vocabulary, dropouts) of an HF GPT-2 config.json."""
    if config.get("model_type") not in (None, "gpt2"):
        raise HFConversionError(f"{path}: model_type {config.get('model_type')!r} is not gpt2")
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GELU:
        raise HFConversionError(f"{path}: activation_function {activation!r} has no Megatron "
                                f"GPT-2 equivalent (supported: {', '.join(_GELU)})")
    for key, fine in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if bool(config.get(key, fine)) != fine:
            raise HFConversionError(f"{path}: {key}={config[key]} is not supported by Megatron's GPT-2")
    if config.get("tie_word_embeddings", True) is False:
        raise HFConversionError(f"{path}: tie_word_embeddings=false is not supported (Megatron's "
                                "GPT-2 ties the output layer to the word embeddings)")
    hidden = int(config["n_embd"])
    positions = int(config.get("n_positions", config.get("n_ctx", 1024)))
    return argparse.Namespace(
        num_layers=int(config["n_layer"]), hidden_size=hidden,
        num_attention_heads=int(config["n_head"]),
        ffn_hidden_size=int(config.get("n_inner") or 4 * hidden),
        kv_channels=hidden // int(config["n_head"]), max_position_embeddings=positions,
        seq_length=positions, vocab_size=int(config["vocab_size"]),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        padded_vocab_size=int(config["vocab_size"]), tokenizer_type="GPT2BPETokenizer",
        layernorm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
        hidden_dropout=float(config.get("resid_pdrop", 0.1)),
        attention_dropout=float(config.get("attn_pdrop", 0.1)),
        init_method_std=float(config.get("initializer_range", 0.02)),
        openai_gelu=_GELU[activation], bias_gelu_fusion=True, masked_softmax_fusion=True,
        params_dtype=torch.float32, fp16=False, bf16=False,
        position_embedding_type="learned_absolute", add_position_embedding=True,
        normalization="LayerNorm", add_bias_linear=True, swiglu=False,
        untie_embeddings_and_output_weights=False, apply_residual_connection_post_layernorm=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
        world_size=1, consumed_train_samples=0, consumed_valid_samples=0, iteration=0)


# ---------------------------------------------------------------------------- directories

def read_hf_dir(path: str, make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
    """A `save_pretrained` GPT-2 directory: config.json + model.safetensors, sharded safetensors
    (model.safetensors.index.json) or pytorch_model.bin."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise HFConversionError(f"--load {path} has no config.json: not a Hugging Face model directory")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    args = args_from_hf_config(config, config_path, make_vocab_size_divisible_by)
    hf = read_hf_tensors(path)
    weights = from_hf_state(hf, args.num_layers, args.num_attention_heads)
    dtype = weights[layout.WORD_EMBEDDINGS].dtype
    args.params_dtype = dtype
    tokenizer = {name: os.path.join(path, name) for name in ("vocab.json", "merges.txt")
                 if os.path.isfile(os.path.join(path, name))}
    return ModelCheckpoint(args=args, weights=weights, tokenizer_files=tokenizer)


def read_converted(path: str, iteration: Optional[object] = None, include_optimizer: bool = False,
                   make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
    """The registry's read (app.checkpoint.formats): `read_hf_dir`; a Hugging Face directory
    has one version (`iteration` unused) and no optimizer state (`include_optimizer` refused by
    app.checkpoint.convert before this is called)."""
    return read_hf_dir(path, make_vocab_size_divisible_by)


def describe_hf(path: str, iteration: Optional[object] = None) -> List[str]:
    """Lines describing a Hugging Face directory: the args it implies, then every tensor."""
    source = read_hf_dir(path)
    lines = [f"Hugging Face directory {path}", *describe(vars(source.args))]
    return lines + describe(dict(read_hf_tensors(path)))


def write_converted(source: ModelCheckpoint, out_dir: str, opts: Any) -> str:
    """The converter's write (opts: app.checkpoint.convert.ConvertOptions); returns what was
    written, in words."""
    if (opts.target_tensor_model_parallel_size, opts.target_pipeline_model_parallel_size) != (1, 1):
        logger.warning("--target-*-parallel-size is ignored for --output-format hf")
    dtype = torch_dtype(opts.target_params_dtype) if opts.target_params_dtype else None
    write_hf_dir(source, out_dir, dtype, opts.max_shard_size, opts.vocab_file, opts.merge_file,
                 opts.metrics_file, os.path.abspath(opts.save))
    if not (opts.vocab_file or source.tokenizer_files):
        logger.warning("no tokenizer files written: pass --vocab-file and --merge-file so "
                       "AutoTokenizer.from_pretrained works")
    return "Hugging Face GPT-2 directory"


def read_hf_tensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    progress = Progress("reading Hugging Face weights")
    if os.path.isfile(os.path.join(path, SAFE_INDEX)):
        with open(os.path.join(path, SAFE_INDEX), encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, SAFE_WEIGHTS)):
        files = [SAFE_WEIGHTS]
    elif os.path.isfile(os.path.join(path, BIN_WEIGHTS)):
        state = torch.load(os.path.join(path, BIN_WEIGHTS), map_location="cpu", weights_only=True)
        for t in state.values():
            progress.add(t)
        progress.report(final=True)
        return state
    else:
        raise HFConversionError(f"--load {path} has neither {SAFE_WEIGHTS}, {SAFE_INDEX} nor "
                                f"{BIN_WEIGHTS}")
    tensors: Dict[str, torch.Tensor] = {}
    for name in files:
        shard = load_file(os.path.join(path, name))
        for t in shard.values():
            progress.add(t)
        tensors.update(shard)
    progress.report(final=True)
    return tensors


def parse_size(text: str) -> int:
    """'2GB' -> 2e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000 (HF's units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 2GB, 500MB or 10GiB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def shard_plan(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[List[str]]:
    """Names grouped into shards of at most `max_bytes` (a larger tensor gets its own shard)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf_dir(source: ModelCheckpoint, out_dir: str, dtype: Optional[torch.dtype] = None,
                 max_shard_size: str = "2GB", vocab_file: Optional[str] = None,
                 merge_file: Optional[str] = None, metrics_file: Optional[str] = None,
                 model_path: Optional[str] = None) -> Dict[str, str]:
    """Write config.json, generation_config.json, safetensors, tokenizer files and the model card
    README.md (app.checkpoint.model_card; `metrics_file` gives its validation loss, `model_path`
    the path its examples load, default `out_dir`) to `out_dir`.

    The vocabulary is trimmed to the tokenizer's size (args.vocab_size). Returns the files
    written, {name: path}.
    """
    from safetensors.torch import save_file
    args = source.args
    blockers = checkpoint_args_blockers(args)
    if blockers:
        raise layout.LayoutError("cannot export to a Hugging Face GPT-2 model: "
                                 + "; ".join(blockers))
    vocab_size = getattr(args, "vocab_size", None)
    tensors = to_hf_state(source.weights, source.num_layers, int(args.num_attention_heads),
                          int(vocab_size) if vocab_size else None)
    dtype = dtype or tensors["transformer.wte.weight"].dtype
    tensors = {k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}
    vocab_file = vocab_file or source.tokenizer_files.get("vocab.json")
    merge_file = merge_file or source.tokenizer_files.get("merges.txt")
    eod = _eod_id(vocab_file) if vocab_file else None
    written: Dict[str, str] = {}
    plan = shard_plan(tensors, parse_size(max_shard_size))
    progress = Progress("writing Hugging Face weights", total=len(tensors))
    weight_map: Dict[str, str] = {}
    for i, names in enumerate(plan):
        file = SAFE_WEIGHTS if len(plan) == 1 else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(out_dir, file),
                  metadata={"format": "pt"})
        for n in names:
            weight_map[n] = file
            progress.add(tensors[n])
        written[file] = os.path.join(out_dir, file)
    if len(plan) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_json(os.path.join(out_dir, SAFE_INDEX),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
        written[SAFE_INDEX] = os.path.join(out_dir, SAFE_INDEX)
    _write_json(os.path.join(out_dir, "config.json"), hf_config(args, dtype, eod))
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod})
    written["config.json"] = os.path.join(out_dir, "config.json")
    if vocab_file and merge_file:
        written.update(write_tokenizer_files(out_dir, vocab_file, merge_file,
                                             int(args.max_position_embeddings)))
    card = model_card(args, source.iteration, sum(t.numel() for t in tensors.values()),
                      model_path or out_dir, metrics_file)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    written["README.md"] = os.path.join(out_dir, "README.md")
    progress.report(final=True)
    return written


def _eod_id(vocab_file: str) -> int:
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    if "<|endoftext|>" not in vocab:
        raise HFConversionError(f"--vocab-file {vocab_file} has no '<|endoftext|>' token")
    return int(vocab["<|endoftext|>"])


def write_tokenizer_files(out_dir: str, vocab_file: str, merge_file: str,
                          model_max_length: int) -> Dict[str, str]:
    """vocab.json, merges.txt and the tokenizer configs AutoTokenizer reads offline (GPT-2's)."""
    written = {}
    for src, name in ((vocab_file, "vocab.json"), (merge_file, "merges.txt")):
        if not os.path.isfile(src):
            raise FileNotFoundError(f"tokenizer file {src} does not exist")
        dst = os.path.join(out_dir, name)
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
        written[name] = dst
    special = "<|endoftext|>"
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length,
        "bos_token": special, "eos_token": special, "unk_token": special, "pad_token": special,
        "add_prefix_space": False, "add_bos_token": False, "clean_up_tokenization_spaces": False})
    _write_json(os.path.join(out_dir, "special_tokens_map.json"),
                {"bos_token": special, "eos_token": special, "unk_token": special,
                 "pad_token": special})
    written["tokenizer_config.json"] = os.path.join(out_dir, "tokenizer_config.json")
    return written


def _write_json(path: str, obj: Dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
