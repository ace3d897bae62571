"""The GPT-2 family's adapter: Hugging Face GPT-2 (`GPT2LMHeadModel`) <-> our GPT-2, weight names
and layouts, config.json, and what of our model GPT-2 cannot express (the directory's files are
app.checkpoint.hf.files').

Layout differences handled both ways:
- HF's Conv1D stores weights [in, out]; ours (nn.Linear / the parallel layers) [out, in];
- HF's fused c_attn rows are [(q, k, v), heads, head_dim]; ours [heads, (q, k, v), head_dim];
- HF's vocabulary is the tokenizer's; ours is padded (pad_vocab_size), so rows are trimmed on
  export and padded again on import;
- HF's lm_head is tied to wte and not stored.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from app.checkpoint import param_layout as layout
from app.checkpoint.hf.adapter import FamilyAdapter, shift_norm_weights
from app.checkpoint.hf.files import (ExportTokenizer, HFConversionError, directory_tokenizer,
                                     import_args, read_hf_tensors, write_directory)
from app.checkpoint.model_args import model_config_from_args
from app.checkpoint.state import ModelCheckpoint
from app.config import ModelConfig
from app.data.tokenizer_identity import TokenizerSpec, compare_tokenizers

GPT2 = "GPT2LMHeadModel"

HF_PREFIX = "transformer."
_NORMS = (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"))
_LINEARS = (("attention.query_key_value", "attn.c_attn"), ("attention.dense", "attn.c_proj"),
            ("mlp.dense_h_to_4h", "mlp.c_fc"), ("mlp.dense_4h_to_h", "mlp.c_proj"))
_IGNORED_HF = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
GPT2_FILES = ("vocab.json", "merges.txt")
"""GPT-2 BPE's tokenizer files (--vocab-file, --merge-file)."""
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}


def gpt2_export_blockers(config: ModelConfig) -> List[str]:
    """Reasons, one per option, why `config` cannot be written as a Hugging Face GPT-2 model.

    Empty when it can. Each reason names the command-line option that set it. Options that
    change only how training runs (sequence parallelism, recompute, dropout, fusions) do not
    block.
    """
    blockers = []
    if config.position_embedding_type != "learned_absolute":
        blockers.append(
            f"--position-embedding-type {config.position_embedding_type}: GPT-2 has only a "
            "learned absolute position table (wpe) and no rotary or ALiBi attention")
    if config.num_kv_heads != config.num_attention_heads:
        blockers.append(
            f"--group-query-attention --num-query-groups {config.num_kv_heads} (with "
            f"{config.num_attention_heads} attention heads): GPT-2's attention (c_attn) has one "
            "key and value head per query head")
    if config.untie_embeddings_and_output_weights:
        blockers.append("--untie-embeddings-and-output-weights: GPT-2's LM head is the word "
                        "embedding matrix (wte) transposed")
    return blockers + [f"{flag}: GPT-2's block has LayerNorm, GeLU, biases and heads of hidden "
                       "/ heads channels (such models export as LlamaForCausalLM)"
                       for flag in config.llama_features]


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

def hf_config(args: argparse.Namespace, dtype: torch.dtype, eod: Optional[int],
              bos: Optional[int] = None) -> Dict:
    """config.json of GPT2LMHeadModel for a model described by Megatron `args` (`bos`: the
    tokenizer's, default `eod` as GPT-2's)."""
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
        "bos_token_id": eod if bos is None else bos, "eos_token_id": eod,
        "dtype": str(dtype).replace("torch.", ""),
    }


def args_from_hf_config(config: Dict, path: str, make_vocab_size_divisible_by: int = 128,
                        tokenizer_model: Optional[str] = None,
                        tokenizer: Optional[Dict[str, Optional[str]]] = None
                        ) -> argparse.Namespace:
    """Megatron args (model shape, vocabulary, dropouts) of an HF GPT-2 config.json; the
    tokenizer is `tokenizer` (import_tokenizer's fields), else GPT-2 BPE unless
    `tokenizer_model` names the directory of another (HuggingFaceTokenizer, as the Llama
    import names it)."""
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
    return import_args(
        num_layers=int(config["n_layer"]), hidden_size=hidden,
        num_attention_heads=int(config["n_head"]),
        ffn_hidden_size=int(config.get("n_inner") or 4 * hidden),
        kv_channels=hidden // int(config["n_head"]), max_position_embeddings=positions,
        seq_length=positions, vocab_size=int(config["vocab_size"]),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        padded_vocab_size=int(config["vocab_size"]),
        **(tokenizer or dict(tokenizer_type="HuggingFaceTokenizer" if tokenizer_model
                             else "GPT2BPETokenizer", tokenizer_model=tokenizer_model)),
        layernorm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
        hidden_dropout=float(config.get("resid_pdrop", 0.1)),
        attention_dropout=float(config.get("attn_pdrop", 0.1)),
        init_method_std=float(config.get("initializer_range", 0.02)),
        openai_gelu=_GELU[activation], position_embedding_type="learned_absolute",
        add_position_embedding=True, normalization="LayerNorm", add_bias_linear=True,
        swiglu=False, untie_embeddings_and_output_weights=False)


# ---------------------------------------------------------------------------- directories

def import_tokenizer(path: str) -> Tuple[Dict[str, Optional[str]], Dict[str, str]]:
    """The tokenizer a GPT-2 directory imports with, as its files say: (the args' tokenizer
    fields, the tokenizer files to carry).

    GPT-2 BPE (GPT2BPETokenizer with the directory's vocab.json and merges.txt) when it has
    both and they are its whole tokenizer: no tokenizer.json, or one holding that same
    vocabulary and merges (app.data.tokenizer_identity; a tokenizer.json that adds tokens, a
    BOS or another pre-tokenizer says otherwise). Else the directory's own tokenizer, a
    tokenizer.json (what transformers' GPT-2 save_pretrained writes today) or a SentencePiece
    export: --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR, the flags that load it
    (a run may also pass GPT2BPETokenizer files of the same vocabulary and merges:
    app.checkpoint.model_args.check_tokenizer). Neither: no tokenizer named."""
    files = {name: os.path.abspath(os.path.join(path, name)) for name in GPT2_FILES
             if os.path.isfile(os.path.join(path, name))}
    own = directory_tokenizer(path)
    if len(files) == len(GPT2_FILES):
        gpt2 = TokenizerSpec("GPT2BPETokenizer", files["vocab.json"], files["merges.txt"])
        if own is None or not os.path.isfile(os.path.join(path, "tokenizer.json")) or \
                compare_tokenizers(TokenizerSpec("HuggingFaceTokenizer",
                                                 tokenizer_model=own), gpt2).same:
            return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab.json"],
                        merge_file=files["merges.txt"], tokenizer_model=None), files
    return dict(tokenizer_type="HuggingFaceTokenizer" if own else "GPT2BPETokenizer",
                tokenizer_model=own, vocab_file=None, merge_file=None), {}


def read_hf_dir(path: str, config: Dict, make_vocab_size_divisible_by: int = 128
                ) -> ModelCheckpoint:
    """A `save_pretrained` GPT-2 directory whose config.json is `config`, with the tokenizer
    its files say (`import_tokenizer`)."""
    fields, tokenizer = import_tokenizer(path)
    args = args_from_hf_config(config, f"{path}/config.json", make_vocab_size_divisible_by,
                               tokenizer=fields)
    weights = from_hf_state(read_hf_tensors(path), args.num_layers, args.num_attention_heads)
    args.params_dtype = weights[layout.WORD_EMBEDDINGS].dtype
    return ModelCheckpoint(args=args, weights=weights, tokenizer_files=tokenizer)


def write_hf_dir(source: ModelCheckpoint, out_dir: str,
                 tokenizer: Optional[ExportTokenizer] = None,
                 dtype: Optional[torch.dtype] = None, max_shard_size: str = "2GB",
                 metrics_file: Optional[str] = None, model_path: Optional[str] = None
                 ) -> Dict[str, str]:
    """`source` as a GPT2LMHeadModel directory (app.checkpoint.hf.files.write_directory), the
    vocabulary trimmed to the tokenizer's size (args.vocab_size). Returns the files written."""
    args, tokenizer = source.args, tokenizer or ExportTokenizer()
    blockers = checkpoint_args_blockers(args)
    if blockers:
        raise layout.LayoutError("cannot export to a Hugging Face GPT-2 model: "
                                 + "; ".join(blockers))
    vocab_size = getattr(args, "vocab_size", None)
    zero_centred = model_config_from_args(args, for_inference=True).layernorm_zero_centered_gamma
    weights = shift_norm_weights(source.weights, 1.0 if zero_centred else 0.0)  # GPT-2's gamma
    tensors = to_hf_state(weights, source.num_layers, int(args.num_attention_heads),
                          int(vocab_size) if vocab_size else None)
    dtype = dtype or tensors["transformer.wte.weight"].dtype
    tensors = {k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}
    return write_directory(out_dir, tensors, hf_config(args, dtype, tokenizer.eos, tokenizer.bos), args,
                           source.iteration, tokenizer, max_shard_size,
                           int(tensors["transformer.wte.weight"].shape[0]), metrics_file,
                           model_path)


class GPT2Adapter(FamilyAdapter):
    """Hugging Face GPT-2, tried first when a model is exported."""

    family = "GPT-2"
    model_types = {"gpt2": GPT2, None: GPT2}  # None: an old GPT-2 config.json
    export_order = 0

    def export_blockers(self, config: ModelConfig) -> List[str]:
        return gpt2_export_blockers(config)

    def export_architecture(self, config: ModelConfig) -> str:
        return GPT2

    read_directory = staticmethod(read_hf_dir)
    write_directory = staticmethod(write_hf_dir)


ADAPTER = GPT2Adapter()
