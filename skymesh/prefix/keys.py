"""Prefix keys for the live balancer: chained hashes of fixed-size chunks of prompt text.

The balancer sees the rendered prompt (:func:`skymesh.prefix.prompt.render_chat` or the
completion prompt), not the replica's token ids, so it keys its prefix trie on text:
chunk ``i`` is characters ``[i * chunk_chars, (i + 1) * chunk_chars)`` and key ``i``
hashes chunks ``0..i`` together, so two prompts share key ``i`` exactly when (up to
64-bit collisions) their first ``(i + 1) * chunk_chars`` characters are equal. Only full
chunks get a key; a tail shorter than a chunk is never shared. The simulator uses the
engine's block hashes instead (``skymesh_replica.engine.hashing``), which have the same shape.

Keys are stable across processes and machines (no salted ``hash()``): each chunk's UTF-32
code points are folded with fixed odd 64-bit weights and a 64-bit finaliser, then chained
as ``h_i = h_(i-1) * P + c_i`` (mod 2**64) and finalised again. Doing this in numpy over
all chunks at once keeps 32 KB of text under 50 us, where a per-chunk blake2b loop costs
about 300 us. The hash is not cryptographic: a crafted collision only misroutes requests.

Parameters: ``chunk_chars`` = 64 (about 16 tokens, the engine's block size),
``max_keys`` = 512 (32 K characters; the rest of a longer prompt is not keyed).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

_U64 = np.uint64
_M64 = (1 << 64) - 1
_LE_U64, _LE_U32 = np.dtype("<u8"), np.dtype("<u4")
_P = 0x100000001B3  # the 64-bit FNV prime: odd, so invertible mod 2**64
_SEED = 0x5EED_C0DE


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _const(v: int) -> np.ndarray:
    # A 0-d array, not a numpy scalar: numpy 2 takes the scalar through its promotion
    # rules on every operation, which costs twice the operation itself on a few dozen keys.
    return np.array(v, dtype=_U64)


_F1, _F2 = _const(0xBF58476D1CE4E5B9), _const(0x94D049BB133111EB)
_S30, _S27, _S31 = _const(30), _const(27), _const(31)
_F1_INV, _F2_INV = pow(0xBF58476D1CE4E5B9, -1, 1 << 64), pow(0x94D049BB133111EB, -1, 1 << 64)


def _finalise(x: np.ndarray) -> np.ndarray:
    # splitmix64's output mix, elementwise: the chained sums are linear, this is not.
    x = x ^ (x >> _S30)
    x *= _F1
    x ^= x >> _S27
    x *= _F2
    x ^= x >> _S31
    return x


@functools.lru_cache(maxsize=8)
def _weights(words: int) -> np.ndarray:
    return np.array([_splitmix64(_SEED + i) | 1 for i in range(words)], dtype=_U64)


@functools.lru_cache(maxsize=8)
def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``P**i`` and ``P**-i`` mod 2**64 for ``i < n`` (numpy integer products wrap)."""
    fwd = np.ones(n, dtype=_U64)
    inv = np.ones(n, dtype=_U64)
    if n > 1:
        fwd[1:] = np.cumprod(np.full(n - 1, _P, dtype=_U64))
        inv[1:] = np.cumprod(np.full(n - 1, pow(_P, -1, 1 << 64), dtype=_U64))
    return fwd, inv


CHUNK_CHARS = 64
MAX_KEYS = 512
# Characters of text the default keys cover; anything past them adds no key.
KEYED_CHARS = CHUNK_CHARS * MAX_KEYS


def text_prefix_keys(text: str, chunk_chars: int = CHUNK_CHARS, max_keys: int = MAX_KEYS
                     ) -> list[int]:
    """Chained 64-bit keys of the full ``chunk_chars``-character chunks of ``text``."""
    return extend_prefix_keys(text, (), chunk_chars, max_keys)


# Prompts whose keyed text repeats (a template or system prompt followed by less than a
# chunk of its own, the identical prompts of a tree's siblings) are hashed once: the keys
# of the last prompts, found by the length and last chunk of their keyed text (hashing
# all of it would cost a fifth of keying it) and then compared whole. Bounded by
# entries, the oldest dropped first: at most this many times KEYED_CHARS characters.
_PROMPTS_MAX = 32
_prompts: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}
# A prompt whose keyed text is new most often shares all but its last chunks with a
# recent one (a shared system prompt, a question of its own that reaches into a chunk):
# the last prompt to start with each first chunk, with its keys' chained sums, so that
# only the chunks after the shared ones are hashed. Bounded as ``_prompts``.
_heads: dict[str, tuple[str, tuple[int, ...], list[int]]] = {}


def prompt_keys(text: str) -> tuple[int, ...]:
    """:func:`text_prefix_keys` of a request's prompt, as a tuple that requests with the
    same keyed text share (it must not be changed)."""
    n = min(len(text) // CHUNK_CHARS, MAX_KEYS)
    if n == 0:
        return ()
    end = n * CHUNK_CHARS
    slot = (end, text[end - CHUNK_CHARS: end])
    known = _prompts.get(slot)
    if known is not None and text.startswith(known[0]):  # the same length: equal
        return known[1]
    keyed = text if len(text) == end else text[:end]
    head = keyed[:CHUNK_CHARS]
    near = _heads.get(head)
    shared = _shared_chunks(keyed, near[0], n) if near is not None else 0
    if near is not None and shared:
        new, sums = _chain(keyed, shared, n, near[2][shared - 1], CHUNK_CHARS, MAX_KEYS,
                           True)
        keys = (*near[1][:shared], *new)
        sums = [*near[2][:shared], *sums]
    else:
        new, sums = _chain(keyed, 0, n, 0, CHUNK_CHARS, MAX_KEYS, True)
        keys = tuple(new)
    _remember_chain(keys[-1], sums[-1])
    if known is None and len(_prompts) >= _PROMPTS_MAX:
        del _prompts[next(iter(_prompts))]
    _prompts[slot] = (keyed, keys)
    if near is None and len(_heads) >= _PROMPTS_MAX:
        del _heads[next(iter(_heads))]
    _heads[head] = (keyed, keys, sums)
    return keys


def _shared_chunks(a: str, b: str, n: int) -> int:
    """How many leading ``CHUNK_CHARS`` chunks ``a`` (``n`` full ones) and ``b`` share:
    a binary search of C-level prefix comparisons."""
    lo, hi = 0, min(n, len(b) // CHUNK_CHARS)
    if a.startswith(b[:hi * CHUNK_CHARS]):
        return hi
    while hi - lo > 1:  # a shares lo chunks, not hi
        mid = (lo + hi) // 2
        if a.startswith(b[:mid * CHUNK_CHARS]):
            lo = mid
        else:
            hi = mid
    return lo


# The chained sum behind the last key of each recent result: extending a prompt's keys
# by its reply (cached_keys) then skips inverting the finaliser (a few us of big-int work).
# Bounded: cleared when full, which only costs the inversions again.
_CHAINED_MAX = 4096
_chained: dict[int, int] = {}


def _remember_chain(key: int, chained: int) -> None:
    if len(_chained) >= _CHAINED_MAX:
        _chained.clear()
    _chained[key] = chained


def _unfinalise(h: int) -> int:
    """The inverse of :func:`_finalise` for one key: the chained sum it was made of."""
    known = _chained.get(h)
    if known is not None:
        return known
    h = (_unshift(h, 31) * _F2_INV) & _M64
    h = (_unshift(h, 27) * _F1_INV) & _M64
    return _unshift(h, 30)


def _unshift(y: int, s: int) -> int:
    """x from y = x ^ (x >> s) (64-bit): each pass fixes s more high bits."""
    x = y
    for _ in range(64 // s):
        x = y ^ (x >> s)
    return x


def extend_prefix_keys(text: str, keys: Sequence[int], chunk_chars: int = CHUNK_CHARS,
                       max_keys: int = MAX_KEYS) -> list[int]:
    """:func:`text_prefix_keys` of ``text`` when ``keys`` are already those of its first
    ``len(keys) * chunk_chars`` characters (a prompt's keys, ``text`` being the prompt
    and its reply): only the chunks after them are hashed, so a request's text is hashed
    once however often its keys are needed."""
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    if max_keys < 0:
        raise ValueError(f"max_keys must be >= 0, got {max_keys}")
    m = len(keys)
    n = min(len(text) // chunk_chars, max_keys)
    if n <= m:
        return list(keys[:n])
    new, sums = _chain(text, m, n, _unfinalise(int(keys[-1])) if m else 0, chunk_chars,
                       max_keys, False)
    _remember_chain(new[-1], sums[-1])
    return [*keys, *new] if m else new


def _chain(text: str, m: int, n: int, last: int, chunk_chars: int, max_keys: int,
           every: bool) -> tuple[list[int], list[int]]:
    """The keys of chunks ``m`` to ``n - 1`` of ``text``, chained on ``last`` (the chained
    sum behind key ``m - 1``; 0 for none; ``n`` <= ``max_keys``), and the chained sums
    behind them: every one with ``every``, else the last only."""
    k = n - m  # new chunks
    if k <= 0:
        return [], []
    # UTF-32 gives one fixed-width code point per character, so chunks are array rows;
    # with an even chunk size two code points share a 64-bit word (half the products).
    # surrogatepass: JSON may carry a lone surrogate ("\ud800"), which strict UTF-32 refuses;
    # it is still one code point, so the rows stay fixed-width.
    data = text[m * chunk_chars: n * chunk_chars].encode("utf-32-le", "surrogatepass")
    # The dtypes as objects, passed by position, and ``dot`` rather than ``@``: on the
    # chunk or two of a reply or a new question numpy's argument handling is most of the
    # cost (0.5 us less a call; the same wrapping uint64 products).
    if chunk_chars % 2 == 0:
        words = np.frombuffer(data, _LE_U64)
        if k == 1:  # one chunk (a short reply, a new question): no rows to shape or list
            return _chain_small([int(words.dot(_weights(chunk_chars // 2)))], last)
        words = words.reshape(k, chunk_chars // 2)
    else:
        words = np.frombuffer(data, _LE_U32).reshape(k, chunk_chars).astype(_U64)
    chunks = words.dot(_weights(words.shape[1]))
    if k <= _SMALL:
        return _chain_small(chunks.tolist(), last)
    fwd, inv = _powers(max_keys + 1)
    # h_i = sum_{j<=i} c_j P^(i-j) = P^i * cumsum(c_j P^-j): the chain without a loop;
    # continuing a chain adds the last known sum times P^(i - m + 1).
    # (np.add.accumulate is np.cumsum without its dispatch layer: a fifth of the cost.)
    chained_all = _finalise(chunks)
    chained_all *= inv[:k]
    chained_all = np.add.accumulate(chained_all)
    chained_all *= fwd[:k]
    if last:
        chained_all += _const(last) * fwd[1: k + 1]
    new: list[int] = _finalise(chained_all).tolist()  # a new array: the sums stay
    return new, chained_all.tolist() if every else [int(chained_all[-1])]


def _chain_small(chunks: list[int], last: int) -> tuple[list[int], list[int]]:
    """:func:`_chain` in plain integers, from the chunks' products: the keys and every
    chained sum."""
    out: list[int] = []
    sums: list[int] = []
    chained = last
    for chunk in chunks:
        # _splitmix_out of the chunk, then of the chained sum, inline (a call each).
        chunk ^= chunk >> 30
        chunk = (chunk * 0xBF58476D1CE4E5B9) & _M64
        chunk ^= chunk >> 27
        chunk = (chunk * 0x94D049BB133111EB) & _M64
        chained = (chained * _P + (chunk ^ (chunk >> 31))) & _M64
        x = chained ^ (chained >> 30)
        x = (x * 0xBF58476D1CE4E5B9) & _M64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _M64
        out.append(x ^ (x >> 31))
        sums.append(chained)
    return out, sums


# Up to this many new chunks, chaining in plain integers (about 1.5 us a chunk, after
# one numpy product for the chunks' words) beats the vectorised chain's fixed cost
# (about 15 us since its constants are 0-d arrays; a chat turn, a short reply, a new
# question after a shared system prompt are a few chunks). The same keys either way.
_SMALL = 8


def _splitmix_out(x: int) -> int:
    """:func:`_finalise` of one integer."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def cached_keys(text: str, prompt: str, prompt_keys: Sequence[int]) -> Sequence[int]:
    """The keys of ``text``, a prompt followed by its reply, given ``prompt_keys``: the
    prompt's own, which are reused when they are all of them (a policy that reads no
    keys leaves a request none), so that only the reply is hashed."""
    if text.startswith(prompt):
        return reply_keys(prompt, prompt_keys, text[len(prompt):])
    return text_prefix_keys(text)


def reply_keys(prompt: str, prompt_keys: Sequence[int], output: str) -> Sequence[int]:
    """:func:`cached_keys` of ``prompt + output`` without building that text: only the
    prompt's unkeyed tail and the reply are joined and hashed. A reply that completes no
    chunk (a short answer after a long prompt) gives back ``prompt_keys`` themselves, not
    a copy; they must not be changed (:func:`prompt_keys`' tuples are shared)."""
    m = len(prompt_keys)
    if m != min(len(prompt) // CHUNK_CHARS, MAX_KEYS):  # not all of the prompt's keys
        return text_prefix_keys(prompt + output)
    n = min((len(prompt) + len(output)) // CHUNK_CHARS, MAX_KEYS)
    if n <= m:
        return prompt_keys
    new, sums = _chain(prompt[m * CHUNK_CHARS:] + output, 0, n - m,
                       _unfinalise(int(prompt_keys[-1])) if m else 0, CHUNK_CHARS,
                       MAX_KEYS, False)
    _remember_chain(new[-1], sums[-1])
    return [*prompt_keys, *new] if m else new
