"""get_batch masks/positions against hand-computed values; MegatronPretrainingSampler slicing/resume."""
import pytest
import torch

from app.data import MegatronPretrainingSampler, get_batch

EOD = 0
TEXT = torch.tensor([[5, 0, 7, 8, 0, 9, 4],
                     [1, 2, 3, 4, 5, 6, 7]])
# row 0 tokens: 5 0 | 7 8 0 | 9   (segments end with EOD)
ALLOWED_ROW0 = [[1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [0, 0, 1, 0, 0, 0],
                [0, 0, 1, 1, 0, 0],
                [0, 0, 1, 1, 1, 0],
                [0, 0, 0, 0, 0, 1]]
CAUSAL = [[1 if k <= q else 0 for k in range(6)] for q in range(6)]


def test_tokens_labels_and_defaults():
    batch = get_batch(TEXT, EOD, False, False, False)
    assert batch["tokens"].tolist() == [[5, 0, 7, 8, 0, 9], [1, 2, 3, 4, 5, 6]]
    assert batch["labels"].tolist() == [[0, 7, 8, 0, 9, 4], [2, 3, 4, 5, 6, 7]]
    assert batch["attention_mask"] is None  # plain causal
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["loss_mask"].tolist() == [[1.0] * 6] * 2
    assert batch["position_ids"].tolist() == [list(range(6))] * 2


def test_reset_flags_match_hand_computation():
    batch = get_batch(TEXT, EOD, reset_position_ids=True, reset_attention_mask=True,
                      eod_mask_loss=True)
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0], list(range(6))]
    assert batch["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 1], [1] * 6]
    mask = batch["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 6, 6)
    # True = masked out (Megatron convention), so allowed = ~mask
    assert (~mask[0, 0]).int().tolist() == ALLOWED_ROW0
    assert (~mask[1, 0]).int().tolist() == CAUSAL


def test_flags_are_independent():
    only_pos = get_batch(TEXT, EOD, True, False, False)
    assert only_pos["attention_mask"] is None
    assert only_pos["loss_mask"].tolist() == [[1.0] * 6] * 2
    only_mask = get_batch(TEXT, EOD, False, True, False)
    assert only_mask["position_ids"].tolist() == [list(range(6))] * 2
    assert (~only_mask["attention_mask"][0, 0]).int().tolist() == ALLOWED_ROW0


def test_get_batch_rejects_bad_shape():
    with pytest.raises(ValueError, match="seq_length"):
        get_batch(torch.tensor([1, 2, 3]), EOD)


def test_sampler_slices_each_global_micro_step_by_rank():
    ranks = [list(MegatronPretrainingSampler(22, 0, 2, r, 2)) for r in range(2)]
    assert ranks[0] == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]
    assert ranks[1] == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]  # 20, 21 dropped
    assert len(MegatronPretrainingSampler(22, 0, 2, 0, 2)) == 5


def test_sampler_resumes_where_it_stopped():
    full = list(MegatronPretrainingSampler(40, 0, 3, 1, 2))
    resumed = list(MegatronPretrainingSampler(40, 12, 3, 1, 2))
    assert resumed == full[2:]  # 12 consumed samples = 2 global micro steps of 6
    assert resumed[0] == [15, 16, 17]


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(total_samples=0), "total_samples"),
    (dict(consumed_samples=10), "consumed_samples"),
    (dict(data_parallel_rank=2), "data_parallel_rank"),
    (dict(micro_batch_size=0), "micro_batch_size"),
])
def test_sampler_validates(kwargs, pattern):
    args = dict(total_samples=10, consumed_samples=0, micro_batch_size=1, data_parallel_rank=0,
                data_parallel_size=2)
    with pytest.raises(ValueError, match=pattern):
        MegatronPretrainingSampler(**{**args, **kwargs})


def test_data_package_does_not_use_torch_distributed():
    import ast
    import pathlib

    import app.data
    offenders = []
    for path in pathlib.Path(app.data.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"]
            offenders += [(path.name, n) for n in names
                          if n.startswith(("torch.distributed", "deepspeed"))]
    assert offenders == []
