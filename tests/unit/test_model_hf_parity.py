"""Our GPT-2 (dropout 0) against Hugging Face's GPT2LMHeadModel with the same weights copied in
through app.checkpoint.hf.families.gpt2's mapping (logits, loss and gradients agree)."""
import pytest
import torch
import torch.nn.functional as F

from app.config import ModelConfig
from app.checkpoint.hf.families.gpt2 import to_hf_state
from app.model import GPT2Model

transformers = pytest.importorskip("transformers")

L, H, HEADS, S, V, B = 2, 32, 4, 16, 96, 2


def _config(openai_gelu: bool) -> ModelConfig:
    return ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                       max_position_embeddings=S, padded_vocab_size=V, hidden_dropout=0.0,
                       attention_dropout=0.0, openai_gelu=openai_gelu, seed=7)


def _hf_tensors(ours: dict) -> dict:
    """Our state (params or grads, by our names) in HF's names and layouts (app.checkpoint.convert's mapping)."""
    return to_hf_state(ours, L, HEADS)


def _models(openai_gelu: bool):
    ours = GPT2Model(_config(openai_gelu))
    hf_config = transformers.GPT2Config(
        n_layer=L, n_embd=H, n_head=HEADS, n_positions=S, vocab_size=V, layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        activation_function="gelu_new" if openai_gelu else "gelu", attn_implementation="eager")
    hf = transformers.GPT2LMHeadModel(hf_config)
    copied = _hf_tensors({n: p.detach() for n, p in ours.named_parameters()})
    hf_state = hf.state_dict()
    with torch.no_grad():
        for name, value in copied.items():
            hf_state[name].copy_(value)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied
    return ours, hf


@pytest.mark.parametrize("openai_gelu", [False, True])
def test_logits_loss_and_grads_match_hugging_face(openai_gelu):
    torch.manual_seed(0)
    ours, hf = _models(openai_gelu)
    tokens = torch.randint(0, V, (B, S + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(S).unsqueeze(0).expand(B, S)

    logits = ours(inputs, positions)  # [b, s, V]
    hf_out = hf(input_ids=inputs, labels=inputs)
    torch.testing.assert_close(logits, hf_out.logits, rtol=1e-5, atol=1e-5)

    loss = ours(inputs, positions, labels=labels)  # [b, s] fp32
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    ref = F.cross_entropy(hf_out.logits.reshape(-1, V), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.view(B, S), rtol=1e-5, atol=1e-5)
    # HF shifts its labels internally: its mean loss is ours without the last position.
    torch.testing.assert_close(loss[:, :-1].mean(), hf_out.loss, rtol=1e-5, atol=1e-6)

    loss[:, :-1].mean().backward()
    hf_out.loss.backward()
    ours_grads = _hf_tensors({n: p.grad for n, p in ours.named_parameters()})
    hf_params = dict(hf.named_parameters())
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, hf_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_parameter_count_matches_config_formula():
    ours, hf = _models(False)
    n = sum(p.numel() for p in ours.parameters())
    assert n == _config(False).num_parameters() == sum(p.numel() for p in hf.parameters())
