"""A small English corpus that ships with orgel, a word tokenizer and LM batches for the demo.

The corpus (``corpus.txt`` next to this file) is made by :func:`generate_corpus`
from a tiny grammar with a fixed seed, so it is reproducible and free of any
licence. :func:`text_batches` turns it into ``(tokens, targets)`` pairs for a
next-token language model such as :class:`orgel.models.gpt.GPT`.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from importlib import resources

import torch

UNK = "<unk>"

_SUBJECTS = [
    "the farmer", "the old miller", "a young fox", "the baker", "my sister", "the organ builder",
    "a tired traveller", "the small cat", "our teacher", "the fisherman", "a quiet student",
    "the river", "the wind", "the choir", "a stranger", "the children", "the captain", "the doctor",
    "the gardener", "an old dog", "the queen", "the blacksmith", "a little bird", "the poet",
]
_VERBS = [
    "carried", "found", "painted", "watched", "built", "followed", "opened", "mended", "sold",
    "heard", "tuned", "cleaned", "counted", "dropped", "lifted", "kept", "borrowed", "visited",
    "forgot", "remembered", "measured", "climbed", "crossed", "played",
]
_OBJECTS = [
    "a wooden box", "the red door", "seven apples", "the heavy bell", "a letter", "the long road",
    "a silver key", "the broken pipe", "an empty basket", "the green boat", "a loaf of bread",
    "the tall tower", "two candles", "the winter coat", "a map of the town", "the oak table",
    "a song", "the bright lamp", "a bag of flour", "the stone bridge", "the last train",
]
_PLACES = [
    "in the morning", "near the mill", "by the sea", "at the market", "under the bridge",
    "before dinner", "in the old church", "after the rain", "on the hill", "across the valley",
    "at midnight", "beside the well", "in the quiet square", "during the storm", "at the station",
]
_ADVERBS = ["slowly", "carefully", "quickly", "happily", "quietly", "again", "proudly", "gently"]
_ADJECTIVES = ["cold", "warm", "bright", "dark", "calm", "busy", "strange", "pleasant", "long"]
_TIMES = ["the day", "the night", "the week", "the evening", "the winter", "the summer"]
_CONNECTORS = ["and then", "because", "but", "while", "so", "although"]


def _clause(rng: random.Random) -> str:
    """One simple clause: subject, verb, object and sometimes an adverb or a place."""
    parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.4:
        parts.append(rng.choice(_ADVERBS))
    if rng.random() < 0.6:
        parts.append(rng.choice(_PLACES))
    return " ".join(parts)


def _sentence(rng: random.Random) -> str:
    """One sentence: a clause, two joined clauses, or a remark about the weather."""
    roll = rng.random()
    if roll < 0.15:
        text = f"{rng.choice(_TIMES)} was {rng.choice(_ADJECTIVES)} and {rng.choice(_ADJECTIVES)}"
    elif roll < 0.5:
        text = f"{_clause(rng)}, {rng.choice(_CONNECTORS)} {_clause(rng)}"
    else:
        text = _clause(rng)
    end = "?" if rng.random() < 0.05 else "."
    return text[0].upper() + text[1:] + end


def generate_corpus(*, seed: int = 0, n_paragraphs: int = 120) -> str:
    """The demo corpus: ``n_paragraphs`` paragraphs of 3-7 simple sentences each."""
    if n_paragraphs <= 0:
        raise ValueError(f"n_paragraphs must be positive, got {n_paragraphs}")
    rng = random.Random(seed)
    paragraphs = [
        " ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(n_paragraphs)
    ]
    return "\n\n".join(paragraphs) + "\n"


def load_corpus() -> str:
    """The text of the shipped ``corpus.txt``."""
    return resources.files(__name__).joinpath("corpus.txt").read_text(encoding="utf-8")


def split_words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks, in order."""
    return re.findall(r"[a-z0-9']+|[^\sa-z0-9']", text.lower())


class WordTokenizer:
    """Word-level tokenizer: the ``vocab_size - 1`` most frequent words, id 0 is ``<unk>``."""

    def __init__(self, vocab: Sequence[str]) -> None:
        if not vocab or vocab[0] != UNK:
            raise ValueError(f"vocab must start with {UNK!r}")
        self.vocab = list(vocab)
        self.ids = {word: i for i, word in enumerate(self.vocab)}

    @classmethod
    def from_text(cls, text: str, vocab_size: int) -> WordTokenizer:
        """Keep the most frequent words of ``text`` (ties broken alphabetically)."""
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2 (<unk> + one word), got {vocab_size}")
        counts = Counter(split_words(text))
        ranked = sorted(counts, key=lambda w: (-counts[w], w))
        return cls([UNK, *ranked[: vocab_size - 1]])

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; unknown words map to 0."""
        return [self.ids.get(word, 0) for word in split_words(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """Words for ``ids`` joined by spaces, with no space before punctuation."""
        out = ""
        for i in ids:
            word = self.vocab[i]
            out += word if (not out or not word[0].isalnum() and word != UNK) else " " + word
        return out


def text_batches(
    batch_size: int, seq_len: int, vocab_size: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(tokens, targets)`` batches of random windows of the corpus.

    Both tensors are int64 ``(batch_size, seq_len)``; ``targets`` is ``tokens``
    shifted by one word. Ids are below ``vocab_size`` (rare words become
    ``<unk>`` = 0). The same ``seed`` gives the same sequence of batches.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    text = load_corpus()
    stream = torch.tensor(WordTokenizer.from_text(text, vocab_size).encode(text))
    if stream.numel() <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is longer than the corpus ({stream.numel()} words)")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size, 1), generator=gen)
        window = stream[starts + offsets]
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


__all__ = [
    "UNK",
    "WordTokenizer",
    "generate_corpus",
    "load_corpus",
    "split_words",
    "text_batches",
]
