"""Param groups (no decay exactly for biases and LayerNorm) and the AdamW builder's update."""
import torch
from torch import nn

from app.config import OptimizerConfig
from app.optim import build_optimizer, get_param_groups


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)


def test_groups_split_biases_and_layernorm():
    model = _Tiny()
    groups = get_param_groups(model, weight_decay=0.1)
    by_name = {g["name"]: g for g in groups}
    ids = lambda ps: {id(p) for p in ps}
    assert ids(by_name["decay"]["params"]) == {id(model.emb.weight), id(model.fc.weight)}
    assert ids(by_name["no_decay"]["params"]) == {id(model.ln.weight), id(model.ln.bias),
                                                  id(model.fc.bias)}
    assert by_name["decay"]["weight_decay"] == 0.1 and by_name["no_decay"]["weight_decay"] == 0.0
    assert "weight_decay" not in get_param_groups(model)[0]


def test_build_optimizer_is_adamw_and_matches_hand_update():
    torch.manual_seed(0)
    model = _Tiny()
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults.get("fused") or opt.defaults.get("foreach")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if name.endswith("bias") or name.startswith("ln.") else 0.1
        g = grads[name]
        m_hat = (1 - 0.8) * g / (1 - 0.8)
        v_hat = (1 - 0.9) * g * g / (1 - 0.9)
        expected = before[name] * (1 - 0.01 * wd) - 0.01 * m_hat / (v_hat.sqrt() + 1e-6)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
