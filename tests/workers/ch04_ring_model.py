"""Bytes each rank sends in the bandwidth-optimal algorithm of every collective, counted by running
the algorithm on n simulated ranks (plain Python lists, no torch.distributed).

This is the independent derivation of the nccl-tests bus factors that tests/test_ch04_*.py compare
``bandwidth_test.py`` against: instead of writing "all_reduce: 2(n-1)/n" a second time, the model
moves chunks between ranks step by step (ring reduce-scatter, ring all-gather, all-reduce as the
two in a row, direct all-to-all, pipelined chain broadcast and reduce, a ring of send/recv), checks
that every rank ends with what the collective's definition says, and counts what each rank sent.
The bus factor is then the most any rank sent divided by the nccl-tests size S of the collective
(the whole buffer; the gathered output of all_gather; the full input of reduce_scatter; the send
buffer of all_to_all).
"""
from __future__ import annotations

from fractions import Fraction

COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "sendrecv"]


class Wire:
    """Point-to-point messages between n ranks; counts the elements each rank sends."""

    def __init__(self, n: int):
        self.n = n
        self.sent = [0] * n

    def send(self, src: int, dst: int, data: list) -> list:
        assert src != dst, "a rank does not send to itself"
        self.sent[src] += len(data)
        return list(data)  # what the receiver gets: a copy


def _chunks(buf: list, n: int) -> list[list]:
    size = len(buf) // n
    return [buf[i * size:(i + 1) * size] for i in range(n)]


def ring_reduce_scatter(wire: Wire, inputs: list[list], steps: int | None = None) -> list[list]:
    """n-1 steps; in step s rank r sends its partial chunk (r - s) mod n to rank r+1, which adds its own.
    Afterwards rank r holds the complete sum of chunk (r + 1) mod n; returned re-indexed so that
    result[c] is the sum of chunk c (held by rank c - 1). ``steps`` (default n-1) exists for the
    negative control: a ring stopped one step early leaves partial sums."""
    n = wire.n
    partial = [_chunks(buf, n) for buf in inputs]  # partial[r][c]: rank r's running sum of chunk c
    for step in range(n - 1 if steps is None else steps):
        messages = [(r, (r - step) % n, wire.send(r, (r + 1) % n, partial[r][(r - step) % n])) for r in range(n)]
        for r, c, data in messages:  # all sends of a step happen at once, then the receivers add
            dst = (r + 1) % n
            partial[dst][c] = [a + b for a, b in zip(partial[dst][c], data)]
    return [partial[(c - 1) % n][c] for c in range(n)]


def ring_all_gather(wire: Wire, owned: list[list], offset: int = 0) -> list[list]:
    """owned[r]: the finished chunk rank r starts with, chunk (r + offset) mod n. n-1 steps; in step s
    rank r forwards chunk (r + offset - s) mod n to rank r+1. Afterwards every rank holds every chunk,
    in chunk order."""
    n = wire.n
    held = [{(r + offset) % n: owned[r]} for r in range(n)]
    for step in range(n - 1):
        messages = [((r + 1) % n, (r + offset - step) % n,
                     wire.send(r, (r + 1) % n, held[r][(r + offset - step) % n])) for r in range(n)]
        for dst, c, data in messages:
            held[dst][c] = data
    return [[x for c in range(n) for x in held[r][c]] for r in range(n)]


def run(collective: str, n: int, count: int) -> tuple[list, list[int], int]:
    """Run ``collective`` on n simulated ranks with ``count``-element buffers (a multiple of n).
    Returns (every rank's result, elements sent per rank, the nccl-tests size S in elements), after
    checking the results against the collective's definition."""
    assert count % n == 0
    wire = Wire(n)
    inputs = [[1000 * r + i for i in range(count)] for r in range(n)]  # element i of rank r
    total = [sum(inputs[r][i] for r in range(n)) for i in range(count)]
    block = count // n
    if collective == "all_reduce":  # reduce-scatter, then all-gather the finished chunks
        sums = ring_reduce_scatter(wire, inputs)  # rank r now holds the sum of chunk r + 1
        results = ring_all_gather(wire, [sums[(r + 1) % n] for r in range(n)], offset=1)
        expected, size = [total] * n, count
    elif collective == "all_gather":  # each rank contributes one block; S = the gathered output
        mine = [inputs[r][:block] for r in range(n)]
        results = ring_all_gather(wire, mine)
        expected, size = [[x for r in range(n) for x in mine[r]]] * n, count
    elif collective == "reduce_scatter":  # S = the full input; rank c ends with the sum of chunk c
        sums = ring_reduce_scatter(wire, inputs)
        results, expected, size = sums, _chunks(total, n), count
    elif collective == "all_to_all":  # block d of rank s goes straight to rank d
        results = [[None] * count for _ in range(n)]
        for s in range(n):
            for d in range(n):
                data = _chunks(inputs[s], n)[d]
                if s != d:
                    data = wire.send(s, d, data)
                results[d][s * block:(s + 1) * block] = data
        expected = [[x for s in range(n) for x in _chunks(inputs[s], n)[d]] for d in range(n)]
        size = count
    elif collective == "broadcast":  # a chain 0 -> 1 -> ... -> n-1 (pipelined in chunks: same bytes)
        results = [None] * n
        results[0] = inputs[0]
        for r in range(n - 1):
            results[r + 1] = wire.send(r, r + 1, results[r])
        expected, size = [inputs[0]] * n, count
    elif collective == "reduce":  # the chain backwards: n-1 -> ... -> 0, each adding its own input
        partial = inputs[n - 1]
        for r in range(n - 1, 0, -1):
            received = wire.send(r, r - 1, partial)
            partial = [a + b for a, b in zip(received, inputs[r - 1])]
        results, expected, size = [partial], [total], count  # only the root's result is defined
    elif collective == "sendrecv":  # every rank sends its buffer to the right, receives from the left
        results = [wire.send((d - 1) % n, d, inputs[(d - 1) % n]) for d in range(n)]
        expected, size = [inputs[(d - 1) % n] for d in range(n)], count
    else:
        raise ValueError(f"unknown collective {collective!r}")
    assert results == expected, f"the simulated {collective} does not compute its definition"
    return results, wire.sent, size


def bus_factor(collective: str, n: int) -> Fraction:
    """Most elements any rank sent / the nccl-tests size S, from a simulated run (n >= 2)."""
    _, sent, size = run(collective, n, count=n * 6)
    return Fraction(max(sent), size)
