"""Generation and evaluation pieces in one process: sampling filters against hand-computed
values, Megatron's top-p decay, batched left-padded greedy and beam search against Hugging Face
generate, the KV cache against recomputation, seeded sampling, and the perplexity windows."""
import argparse

import pytest
import torch

from app.config import ModelConfig
from app.checkpoint.hf.families.gpt2 import hf_config, to_hf_state
from app.inference.zeroshot import (PerplexityResult, count_words, perplexity, sliding_windows,
                                   wikitext_detokenize)
from app.inference.generation import beam_search, generate
from app.inference.kv_cache import KVCache
from app.inference.runner import PipelineRunner
from app.inference.sampling import SamplingConfig, choose_tokens, filter_top_k, filter_top_p
from app.model import GPT2Model
from app.mpu.parallel_state import ParallelState

transformers = pytest.importorskip("transformers")

L, H, HEADS, V, PADDED, POS, EOD = 2, 32, 4, 90, 96, 48, 0
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def models():
    """Our model (init std 0.3, so the logits are far from uniform) and HF's with its weights."""
    config = ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=POS,
                         max_position_embeddings=POS, padded_vocab_size=PADDED, hidden_dropout=0.0,
                         attention_dropout=0.0, init_method_std=0.3, seed=5)
    ours = GPT2Model(config).eval()
    args = argparse.Namespace(num_layers=L, hidden_size=H, num_attention_heads=HEADS,
                              ffn_hidden_size=4 * H, max_position_embeddings=POS, vocab_size=V,
                              padded_vocab_size=PADDED, openai_gelu=False, layernorm_epsilon=1e-5)
    fields = {k: v for k, v in hf_config(args, torch.float32, EOD).items()
              if k not in ("architectures", "dtype")}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)).eval()
    state = to_hf_state({n: p.detach() for n, p in ours.named_parameters()}, L, HEADS, V)
    result = hf.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied
    runner = PipelineRunner(ours, ParallelState.single(), H, torch.device("cpu"))
    return runner, hf


def _hf_generate(hf, prompts, **kwargs):
    """HF generate on left-padded prompts with an attention mask; new tokens per row."""
    width = max(map(len, prompts))
    ids = torch.tensor([[EOD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=EOD,
                      pad_token_id=EOD, **kwargs)
    return [row[width:].tolist() for row in out]


def test_batched_greedy_equals_hf_and_the_cache_equals_recomputation(models):
    runner, hf = models
    greedy = SamplingConfig(greedy=True)
    cached = generate(runner, PROMPTS, 20, greedy, EOD, V, POS)
    recomputed = generate(runner, PROMPTS, 20, greedy, EOD, V, POS, use_cache=False)
    assert cached.tokens == recomputed.tokens
    for got, want in zip(cached.tokens, _hf_generate(hf, PROMPTS, max_new_tokens=20)):
        assert got == want[:len(got)] and (len(got) == 20 or got[-1] == EOD)
    for prompt, got in zip(PROMPTS, cached.tokens):  # a row alone == the row in the batch
        assert generate(runner, [prompt], 20, greedy, EOD, V, POS).tokens[0] == got
    assert cached.prefill_tokens == 3 * 8 and cached.decode_tokens_per_s > 0


@pytest.mark.parametrize("num_beams,length_penalty", [(3, 1.0), (4, 0.5), (2, 2.0)])
def test_beam_search_equals_hf(models, num_beams, length_penalty):
    runner, hf = models
    for prompt in PROMPTS:
        ours = beam_search(runner, prompt, 12, num_beams, length_penalty, EOD, V, POS)
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, num_beams=num_beams,
                          length_penalty=length_penalty, do_sample=False, eos_token_id=EOD,
                          pad_token_id=EOD, output_scores=True, return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].tolist()
        assert ours.tokens[0] == want[:len(ours.tokens[0])]
        assert ours.scores[0] == pytest.approx(float(out.sequences_scores[0]), rel=1e-5)


def test_seeded_sampling_is_reproducible(models):
    runner, _ = models
    config = lambda seed: SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, seed=seed)  # noqa
    a = generate(runner, PROMPTS, 10, config(3), EOD, V, POS).tokens
    assert generate(runner, PROMPTS, 10, config(3), EOD, V, POS).tokens == a
    assert generate(runner, PROMPTS, 10, config(4), EOD, V, POS).tokens != a
    assert all(t < V for row in a for t in row)  # padding rows of the vocabulary never chosen


def test_filters_against_hand_computed_values():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    assert torch.isinf(filter_top_k(logits, 2)).tolist() == [[False, True, True, True, False]]
    probs = torch.softmax(logits, -1)[0]  # sorted: 4 (.64), 0 (.24), 1 (.09), 2, 3
    assert probs[4] < 0.7 < probs[4] + probs[0]
    kept = ~torch.isinf(filter_top_p(logits, 0.7))  # .64 < .7: the token crossing .7 is kept
    assert kept.tolist() == [[True, False, False, False, True]]
    assert (~torch.isinf(filter_top_p(logits, 0.5))).sum() == 1
    assert choose_tokens(logits, SamplingConfig(greedy=True), 0.0, None).tolist() == [4]
    gen = torch.Generator().manual_seed(0)
    draws = {int(choose_tokens(logits, SamplingConfig(top_p=0.7), 0.7, gen)) for _ in range(50)}
    assert draws == {0, 4}


def test_megatron_top_p_decay_and_bound_and_validation():
    config = SamplingConfig(top_p=0.9, top_p_decay=0.5, top_p_bound=0.3)
    p, seen = 0.9, []
    for _ in range(4):
        p = config.next_top_p(p)
        seen.append(p)
    assert seen == pytest.approx([0.45, 0.3, 0.3, 0.3])
    assert SamplingConfig(top_k=1).greedy
    for bad in (dict(temperature=0.0), dict(top_p=1.5), dict(top_k=-1),
                dict(top_p=0.2, top_p_bound=0.5)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_kv_cache_bounds_and_reorder():
    cache = KVCache(batch_size=2, max_length=4)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    keys, _ = cache.append(0, k, k)
    assert torch.equal(keys, k)
    cache.advance(3)
    cache.reorder(torch.tensor([1, 1]))
    keys, _ = cache.append(0, k[:, :, :1], k[:, :, :1])
    assert torch.equal(keys[0, :, :3], k[1]) and torch.equal(keys[:, :, 3], k[:, :, 0])
    cache.advance(1)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.append(0, k[:, :, :1], k[:, :, :1])


def test_sliding_windows_score_every_target_once():
    tokens = list(range(1, 102))  # 100 targets
    for stride in (None, 16, 7, 1):
        windows = sliding_windows(tokens, 32, stride, pad_id=0)
        scored = []
        for i, (window, mask) in enumerate(windows):
            assert len(window) == 33 and len(mask) == 32
            scored += [window[j + 1] for j, m in enumerate(mask) if m]
            assert window[0] == tokens[i * (stride or 32)]  # window i starts at i * stride
        assert scored == tokens[1:], stride
    result = PerplexityResult(total_loss=50.0, scored_tokens=100, num_tokenized_tokens=101,
                              num_original_tokens=51).metrics()
    assert result["loss"] == 0.5 and result["token_ratio"] == 2.0
    assert result["adjusted_ppl"] == pytest.approx(2.718281828, rel=1e-6)


def test_perplexity_windows_batches_and_progress(models, capfd):
    """Summed loss of non-overlapping windows in micro-batches of 2 equals the cross-entropy of
    one forward of all windows' logits (padded vocabulary, as Megatron scores); the evaluation
    reports its batches with rate and ETA on stderr."""
    runner, _ = models
    tokens = [(7 * i + 3) % V for i in range(3 * 16 + 1)]  # 48 targets: three windows of 16
    total, scored = perplexity(runner, tokens, 16, None, pad_id=EOD, micro_batch_size=2)
    with torch.no_grad():
        windows = torch.tensor(tokens[:-1]).view(3, 16)  # [3, 16]
        labels = torch.tensor(tokens[1:]).view(3, 16)  # [3, 16]
        logits = runner.forward(windows, torch.arange(16).expand(3, -1))  # [3, 16, PADDED]
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, PADDED).double(),
                                                 labels.reshape(-1), reduction="sum")
    assert scored == 48 and total == pytest.approx(float(want), rel=1e-6)
    err = capfd.readouterr().err
    assert "perplexity: 100% 2/2" in err and "ETA" in err and "batches/s" in err


def test_wikitext_detokenizer_and_word_count():
    raw = " = Valkyria Chronicles = \n the 1 @,@ 000 @-@ year ( old ) war , he said \" yes \" . "
    assert wikitext_detokenize(raw) == (" = Valkyria Chronicles =\nthe 1,000-year (old) war, he "
                                        'said "yes". ')
    assert count_words(" a b  c ") == 4  # Megatron splits the stripped text on single spaces
