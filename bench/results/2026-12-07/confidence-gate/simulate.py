"""The greedy loop replayed over `study.py`'s rows under verify-width policies, with c=1 costs.

    python simulate.py rows.npz [--draft-ms 7.0] [--extra-ms 2.5]

Costs (ms, SmolLM2 on the 2-core CPU, `draft_phase.py`): the target's forward over w tokens
TARGET_MS[w], a plain step TARGET_MS[1]; a drafting step adds the drafter forward and a fixed
extra (acceptance and bookkeeping, the lost lookahead overlap). Policies:
- plain; fixed depth d;
- gate: draft every step, then verify the width w (0..7) that maximises E[tokens] - rate * cost,
  E[tokens] from the rows' top-1 probabilities calibrated per row and bin on the other half of
  the records (cross-fitted), `rate` iterated to the policy's own (Dinkelbach);
- oracle: the width that would be accepted (an upper bound).
Prints tokens a step and tokens a second relative to plain, per kind and overall.
"""

from __future__ import annotations

import argparse

import numpy as np

TARGET_MS = {1: 52.5, 2: 59.0, 3: 63.6, 4: 68.5, 5: 69.6, 6: 70.7, 7: 71.8, 8: 73.0}
BINS = np.array([0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01])


def calibrate(probs: np.ndarray, hits: np.ndarray, fit: np.ndarray) -> np.ndarray:
    """q[n, k]: P(row k hit | rows before it hit, its probability's bin), from rows `fit`."""
    runs = np.cumprod(hits, axis=1)
    alive = np.concatenate([np.ones((len(hits), 1), bool), runs[:, :-1].astype(bool)], axis=1)
    q = np.zeros_like(probs)
    for k in range(probs.shape[1]):
        b = np.clip(np.digitize(probs[:, k], BINS) - 1, 0, len(BINS) - 2)
        for i in range(len(BINS) - 1):
            sel = fit & alive[:, k] & (b == i)
            rate = (hits[sel, k].sum() + 1) / (sel.sum() + 2)
            q[b == i, k] = rate
    return q


def replay(runs_at, choose, draft_ms, extra_ms):
    """Greedy loop over one record: (tokens, ms)."""
    pos = tokens = 0
    ms = 0.0
    while pos < len(runs_at):
        w = choose(pos)
        if w is None:  # plain step
            ms += TARGET_MS[1]
            pos += 1
            tokens += 1
            continue
        ms += draft_ms + extra_ms + TARGET_MS[w + 1]
        accepted = min(runs_at[pos], w)
        pos += accepted + 1
        tokens += accepted + 1
    return tokens, ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rows")
    parser.add_argument("--draft-ms", type=float, default=7.0)
    parser.add_argument("--extra-ms", type=float, default=2.5)
    args = parser.parse_args()
    data = np.load(args.rows)
    probs, hits, kinds, records = data["probs"], data["hits"], data["kinds"], data["records"]
    runs = np.cumprod(hits, axis=1).sum(1)
    q = np.zeros_like(probs)
    for fold in (0, 1):
        fitted = calibrate(probs, hits, records % 2 != fold)
        q[records % 2 == fold] = fitted[records % 2 == fold]
    expected = 1 + np.cumsum(np.cumprod(q, axis=1), axis=1)  # E[tokens] at widths 1..7
    expected = np.concatenate([np.ones((len(q), 1)), expected], axis=1)  # width 0
    cost = np.array([args.draft_ms + args.extra_ms + TARGET_MS[w + 1] for w in range(8)])

    def run(policy, sel_kind=None):
        tok = ms = 0.0
        for r in np.unique(records):
            idx = np.where(records == r)[0]
            if sel_kind is not None and kinds[idx[0]] != sel_kind:
                continue
            t, m = replay(
                runs[idx], lambda p, idx=idx: policy(idx[p]), args.draft_ms, args.extra_ms
            )
            tok += t
            ms += m
        return tok, ms

    def gate(rate):
        return lambda n: int(np.argmax(expected[n] - rate * cost))

    policies = {"plain": lambda n: None}
    for d in (1, 2, 3, 7):
        policies[f"depth {d}"] = lambda n, d=d: d
    rate = 1 / TARGET_MS[1]
    for _ in range(6):  # Dinkelbach: the rate the gate itself reaches
        t, m = run(gate(rate))
        rate = t / m
    policies["gate"] = gate(rate)
    policies["oracle"] = lambda n: int(np.argmax(
        np.minimum(runs[n], np.arange(8)) + 1 - (1 / TARGET_MS[1]) * cost * 0.999))  # fmt: skip
    for kind in [None, *sorted(set(kinds))]:
        base_t, base_ms = run(policies["plain"], kind)
        line = []
        for name, policy in policies.items():
            t, m = run(policy, kind)
            line.append(f"{name} {t / m / (base_t / base_ms):.3f}")
        print(f"{kind or 'all':>10}: " + " | ".join(line))


if __name__ == "__main__":
    main()
