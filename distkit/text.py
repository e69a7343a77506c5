"""Real text for the transformer chapters, offline on every machine: Python's own reference
documentation, byte by byte.

Every CPython ships the text of its language reference's topics (``pydoc_data.topics``, what
``help("assert")`` prints): about 0.47 M characters of English prose, grammar and examples. Encoded
as UTF-8 it is a stream of bytes, and a byte is a token: a vocabulary of 256, no tokenizer, nothing
to download. The text differs a little between Python releases, so a run names its corpus by
Python version, size and digest (:func:`corpus_info`).

:class:`TextTask` has the synthetic task's interface (``distkit.models.TokenTask``):
``global_batch(step, batch_size)`` gives the same ``(inputs, targets)`` in every process, so the
same ``rank_slice``, micro-batch and context-parallel slicing code serves both. The first 90% of the
stream is for training, cut into windows of ``seq_len + 1`` bytes and visited in one seeded order
per pass; the last 10% is held out (:meth:`TextTask.held_out`).

    --data synthetic   the Markov-chain task (default): sharp, fast, its loss floor is ln 2
    --data text        this corpus: a loss curve like the ones you watch, and text a model can write
"""
from __future__ import annotations

import hashlib
import sys

import torch

VOCAB = 256  # bytes
HELD_OUT_FRACTION = 0.1


def corpus_bytes() -> bytes:
    """The topics of this Python's reference documentation, in sorted order, as UTF-8."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics)).encode("utf-8")


def corpus_info() -> dict:
    """What a record says about the text it trained on."""
    data = corpus_bytes()
    return {"name": "pydoc_data.topics", "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "bytes": len(data), "sha1": hashlib.sha1(data).hexdigest()[:12]}


class TextTask:
    """Global batches of byte windows from the corpus (``TokenTask``'s interface).

    Step ``s`` takes windows ``s*B ... s*B + B - 1`` of the training order: the non-overlapping
    windows of the training split, shuffled once per pass with ``seed + pass``. Every process builds
    the same order, so a rank's slice, a micro-batch or a CP chunk of it is what one process trained on.
    """

    def __init__(self, cfg, seed: int = 0):
        if cfg.vocab_size < VOCAB:
            raise ValueError(f"the text task has {VOCAB} byte tokens; the model's vocabulary is {cfg.vocab_size}")
        self.cfg, self.seed = cfg, seed
        stream = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
        split = int(len(stream) * (1 - HELD_OUT_FRACTION))
        width = cfg.seq_len + 1
        self.train = stream[:split // width * width].view(-1, width)  # (windows, seq_len + 1)
        self.held = stream[split:split + (len(stream) - split) // width * width].view(-1, width)
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.train), generator=gen)}  # keep one pass
        return self._orders[epoch]

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of step ``step``: ``batch_size`` windows of the training split."""
        index = step * batch_size + torch.arange(batch_size)
        windows = torch.stack([self.train[self._order(int(i) // len(self.train))[int(i) % len(self.train)]]
                               for i in index])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def held_out(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``batch_size`` windows of the held-out split (fixed: the same every time)."""
        if batch_size > len(self.held):
            raise ValueError(f"the held-out split has {len(self.held)} windows of {self.cfg.seq_len + 1} bytes")
        windows = self.held[:batch_size]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def make_task(cfg, args, **synthetic_options):
    """The task ``--data`` names: the synthetic ``TokenTask`` (with ``synthetic_options``, e.g.
    ``num_sequences``) or :class:`TextTask`, seeded by ``--seed``."""
    from .models import TokenTask

    if getattr(args, "data", "synthetic") == "text":
        return TextTask(cfg, seed=args.seed)
    return TokenTask(cfg, seed=args.seed, **synthetic_options)


@torch.no_grad()
def generate(model, prompt: str, new_bytes: int, seq_len: int, device) -> str:
    """``prompt`` continued by ``new_bytes`` bytes, each the model's most likely next byte given the
    last ``seq_len`` (greedy). Every rank of a sharded model must call it (its forward is collective)."""
    tokens = torch.tensor(list(prompt.encode("utf-8")), dtype=torch.long, device=device)[None]
    for _ in range(new_bytes):
        logits = model(tokens[:, -seq_len:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
