"""GVM's p_i and G_i from a prompt's earlier rollouts (`sampling.gvm_estimates: history`).

GVM's stage 1 draws N' samples of every prompt of a step only to estimate its acceptance rate p_i and
gradient norm G_i, so a step draws P (N' + N'') samples for a budget of P N''. Epochs revisit prompts,
and the stage-2 samples of a prompt's last visit are draws from a recent policy; with history estimates
they are kept per prompt and stage 1 runs only where they are missing or say nothing:

  prompt never seen             N' stage-1 samples (as in stage1 mode)
  solved at an earlier visit    no stage-1 sample: p_i, G_i from the history
  unsolved so far               `gvm_history_probe` samples (0: never drawn again once unsolved), and
                                none once it has been drawn at `gvm_history_probe_visits` visits
                                without an accepted sample (0: probed at every visit)

Each visit's counts join the history with the older ones discounted by `gvm_history_decay`:
p_i = (a + d a_old) / (m + d m_old) over accepted a of m drawn, and G_i the same discounted mean of the
accepted samples' gradient norms (taken on at most N' accepted samples per prompt and visit). The store is
a JSON-able dict saved with each checkpoint, keyed by the record's "id" (its question when it has none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def prompt_key(record: dict) -> str:
    """The history's key of a prompt record: its "id", or its question when the record has no id."""
    key = record.get("id")
    return str(key) if key not in (None, "") else "question:" + str(record.get("question", record.get("prompt", "")))


@dataclass
class GvmHistory:
    """Per prompt: discounted accepted and drawn counts, the discounted sum and count of accepted samples'
    gradient norms, the last visit that drew it and how many visits drew it.
    `entries[key] = [accepted, drawn, norm_sum, norm_count, last_visit, visits]`."""

    decay: float = 0.5
    entries: dict[str, list[float]] = field(default_factory=dict)

    def estimates(self, records: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seen, p, G) over `records`: seen [P] bool, p = accepted / drawn, G = the mean gradient norm of the
        accepted samples (0 where none was accepted or none measured)."""
        rows = [self.entries.get(prompt_key(r)) for r in records]
        seen = np.array([e is not None and e[1] > 0 for e in rows], bool)
        p = np.array([e[0] / e[1] if e is not None and e[1] > 0 else 0.0 for e in rows], np.float64)
        g = np.array([e[2] / e[3] if e is not None and e[3] > 0 else 0.0 for e in rows], np.float64)
        return seen, p, g

    def observe(self, records: list[dict], accepted, drawn, norm_sum, norm_count, *, visit: int) -> None:
        """Add one visit's counts ([P] each) for the prompts with drawn > 0. The older counts of a prompt are
        multiplied by `decay` once per visit, so two observations in the same `visit` (a probe, then stage 2)
        add up undiscounted."""
        for i, record in enumerate(records):
            if drawn[i] <= 0:
                continue
            key = prompt_key(record)
            old = self.entries.get(key, [0.0, 0.0, 0.0, 0.0, visit, 0.0])
            new_visit = old[5] == 0 or old[4] != visit
            if old[4] != visit:
                old = [self.decay * v for v in old[:4]] + old[4:]
            self.entries[key] = [old[0] + float(accepted[i]), old[1] + float(drawn[i]),
                                 old[2] + float(norm_sum[i]), old[3] + float(norm_count[i]), visit,
                                 old[5] + float(new_visit)]

    def probe_counts(self, records: list[dict], stage1_samples: int, probe_samples: int,
                     probe_visits: int = 0) -> np.ndarray:
        """Stage-1 samples per prompt: N' where unseen, 0 where solved before, `probe_samples` where unsolved
        at fewer than `probe_visits` visits so far (every visit when 0), else 0."""
        seen, p, _ = self.estimates(records)
        visits = np.array([self.entries[prompt_key(r)][5] if s else 0 for r, s in zip(records, seen)])
        probe = probe_samples * ((probe_visits <= 0) | (visits < probe_visits))
        return np.where(~seen, stage1_samples, np.where(p > 0, 0, probe)).astype(np.int64)

    def to_json(self) -> dict:
        return {"decay": self.decay, "entries": self.entries}

    @classmethod
    def from_json(cls, data: dict) -> "GvmHistory":
        try:
            entries = {str(k): [float(x) for x in v] for k, v in data["entries"].items()}
            if any(len(v) not in (5, 6) for v in entries.values()):
                raise ValueError("each entry must be [accepted, drawn, norm_sum, norm_count, last_visit, visits]")
            # Checkpoints written before the visit count: at least the one visit that made the entry.
            entries = {k: v if len(v) == 6 else [*v, 1.0] for k, v in entries.items()}
            return cls(decay=float(data["decay"]), entries=entries)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"checkpoint's gvm_history is malformed ({error}); expected "
                             "{'decay': d, 'entries': {prompt_key: [accepted, drawn, norm_sum, norm_count, last_visit, visits]}}"
                             ) from error
