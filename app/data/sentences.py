"""Sentence splitting for `preprocess_data.py --split-sentences`: nltk Punkt, never downloaded.

Punkt's unsupervised trainer learns abbreviations, collocations and sentence starters from raw
text, so it is trained on the input itself (or a sample of it); a model saved earlier can be
loaded instead. Models are stored in nltk's `punkt_tab` layout (four text files), read and
written here with plain file I/O so that any directory works.
"""
from __future__ import annotations

import os
from typing import List

PUNKT_FILES = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")


def train_punkt(text: str):
    """PunktParameters learned by nltk's unsupervised PunktTrainer from `text`."""
    from nltk.tokenize.punkt import PunktTrainer

    trainer = PunktTrainer()
    trainer.train(text, finalize=True)
    return trainer.get_params()


def _lines(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.rstrip("\n")]


def load_punkt_params(model_dir: str):
    """PunktParameters from a punkt_tab directory; errors name the missing file."""
    from nltk.tokenize.punkt import PunktParameters

    missing = [n for n in PUNKT_FILES if not os.path.isfile(os.path.join(model_dir, n))]
    if missing:
        raise FileNotFoundError(f"--punkt-model {model_dir!r} lacks {', '.join(missing)}; give a "
                                f"directory in nltk's punkt_tab layout (e.g. one written by "
                                f"--save-punkt-model)")
    params = PunktParameters()
    params.collocations = {tuple(line.split("\t")[:2])
                           for line in _lines(os.path.join(model_dir, "collocations.tab"))}
    params.sent_starters = set(_lines(os.path.join(model_dir, "sent_starters.txt")))
    params.abbrev_types = set(_lines(os.path.join(model_dir, "abbrev_types.txt")))
    for line in _lines(os.path.join(model_dir, "ortho_context.tab")):
        word, flags = line.rsplit("\t", 1)
        params.ortho_context[word] = int(flags)
    return params


def save_punkt_params(params, model_dir: str) -> None:
    """Write PunktParameters to `model_dir` in the punkt_tab layout (sorted, deterministic)."""
    os.makedirs(model_dir, exist_ok=True)
    contents = {
        "collocations.tab": ["\t".join(pair) for pair in sorted(params.collocations)],
        "sent_starters.txt": sorted(params.sent_starters),
        "abbrev_types.txt": sorted(params.abbrev_types),
        "ortho_context.tab": [f"{w}\t{v}" for w, v in sorted(params.ortho_context.items())],
    }
    for name, lines in contents.items():
        with open(os.path.join(model_dir, name), "w", encoding="utf-8", newline="") as f:
            f.write("".join(line + "\n" for line in lines))


class SentenceSplitter:
    """split(text) -> sentences. With keep_newlines the pieces concatenate back to `text`
    exactly (the whitespace between sentences stays at the end of the earlier one); without,
    Punkt's sentences are returned with the whitespace between them dropped."""

    def __init__(self, params, keep_newlines: bool = False) -> None:
        from nltk.tokenize.punkt import PunktSentenceTokenizer

        self._punkt = PunktSentenceTokenizer(params)
        self.keep_newlines = keep_newlines

    def split(self, text: str) -> List[str]:
        if not self.keep_newlines:
            return self._punkt.tokenize(text)
        starts = [start for start, _ in self._punkt.span_tokenize(text)]
        if not starts:
            return [text]
        starts[0] = 0  # leading whitespace stays with the first sentence
        return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
