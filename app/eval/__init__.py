"""Zero-shot evaluation (WikiText-style perplexity, LAMBADA) on our GPT-2 at any TP/PP."""
