"""How each bucket is exchanged, chosen at run time from measured times, alike on every rank.

Chunking: a candidate is a chunk size in float32 bytes (0: the whole bucket at once). The
numbers of the codes exchange do not depend on it (hvd_aps._layout), so trying chunkings changes
no bit. Each bucket runs its first exchange as a warm-up (allocations, page faults: not timed),
then every candidate TRIALS times, one exchange each; each rank's wall time of an exchange (from
its metadata Max-allreduce on, where the ranks meet: no wait for a rank still in its backward)
rides on the bucket's next metadata Max-allreduce, so every rank records the slowest rank's time
and makes the same choice: the least median, fixed from then on.

Policy "auto" (opt-in: it changes what is sent): once every bucket's chunking is fixed, the
schedule times whole steps with codes and whole steps with every bucket on the framework's own
allreduce (NATIVE), in blocks that alternate (codes, native, codes, native: a machine whose speed
drifts over the trials slows both alike; two phases one after the other once kept codes that
were 12 % slower). Each block starts with WARMUP_STEPS untimed steps (the first steps after a
switch renegotiate names in Horovod's response cache and fill new buffers: on a 2-core netns
cluster they ran up to 2x the steady step). Whole steps, not exchanges: codes cost CPU that
backward would have used, which an exchange's own time does not show. The next step's exchanges
carry both medians on their metadata Max-allreduce, and when that step commits every rank
decides alike, for every bucket (never within a step, whose exchanges must all run the same
way). Steps vary by a quarter from one to the next (on a 2-core netns cluster at 1 Gbit/s, through
Horovod's optimizer: codes 130-315 ms, native 200-373 ms), so a round of STEP_TRIALS steps each can
mistake the slower path for the faster: where the agreed medians lie within CLEAR_MARGIN of each
other, another round runs (up to ROUNDS), its steps pooled with the earlier ones; then codes must
be CODES_MARGIN faster to be kept. The decisions are in the compressor's state_dict, so a
resumed run keeps them.

With a link to predict from (`link`: HVD_APS_LINK, hvd_aps.calibration.job_link), policy="auto"
starts from the performance model (hvd_aps.perf): after the first block of trial steps (codes,
at the chunking fixed), each rank predicts the framework's step from its median codes step, the
codes exchanges' measured time taken out and the model's allreduce of every bucket over the link
put in; the next step agrees both on its metadata (the slowest rank's), and where they differ by
more than PRIOR_MARGIN the decision is made there, with no native trial step. A closer call goes
on with the trials, the codes steps already timed kept. Both the prediction and the trials'
medians are reported. policy="codes" with a link makes the same prediction once, and logs a
warning naming policy="auto" where the framework's own step is predicted PRIOR_MARGIN shorter.
"""
import dataclasses
import logging
import statistics
import threading
import time

import numpy as np

from . import perf

NATIVE = -1
ENTRIES = 4       # timing entries on the metadata vector (Schedule.entries)
TRIALS = 2        # timed exchanges per chunking
TRIAL_ORDER = ("codes", "native") * 2  # policy="auto"'s blocks of trial steps
BLOCK_STEPS = 3   # timed steps per block: STEP_TRIALS per policy
STEP_TRIALS = BLOCK_STEPS * TRIAL_ORDER.count("codes")
WARMUP_STEPS = 1  # untimed steps at the start of each block
TRIAL_STEPS = len(TRIAL_ORDER) * (WARMUP_STEPS + BLOCK_STEPS)  # a round: from the fixed chunking to its deciding step
# medians closer than this (a fraction of the native one) call for another round of trials
CLEAR_MARGIN = 0.15
ROUNDS = 3  # rounds of trials at most
MAX_TRIAL_STEPS = ROUNDS * (TRIAL_STEPS + 1)  # every round's steps and its deciding step
# policy="auto" keeps codes only where their median step is this much shorter than the native one:
# the medians of six steps that vary by a quarter differ by about that much for equal policies
CODES_MARGIN = 0.05
# a predicted step margin past this (a fraction of the faster step) decides without trial steps:
# the model's median error on this project's cluster rows is 11-14 %, 81-86 % of them within 25 %
# (docs/performance-model.md)
PRIOR_MARGIN = 0.25
UNMEASURED = -1.0  # a timing entry with no measurement behind it
log = logging.getLogger("hvd_aps")


@dataclasses.dataclass
class _Watch:
    """policy="codes" with a link: this rank's steps once the chunking is fixed, for one prediction."""
    steps: list = dataclasses.field(default_factory=list)
    last: float = None  # when the last step committed
    done: bool = False


@dataclasses.dataclass
class _Bucket:
    times: dict = dataclasses.field(default_factory=dict)  # candidate -> agreed seconds of its trials
    runs: int = 0                 # exchanges whose timing was recorded (the first is the warm-up)
    chosen: int = None            # the decision, once made
    last: tuple = None            # this rank's (candidate, seconds) of its last exchange, not yet sent
    pending: tuple = None         # (candidate, seconds) agreed this step, recorded at commit


class _Policy:
    """policy="auto"'s step trials: blocks of codes and native steps (TRIAL_ORDER), then the
    agreed decision."""
    PHASES = ("chunking", "trials", "deciding", "decided")

    def __init__(self):
        self.phase, self.steps, self.chosen, self.last_commit = "chunking", {"codes": [], "native": []}, None, None
        self.medians = None  # the agreed (codes, native) step medians behind the decision
        self.block, self.timed = 0, 0  # the trial block under way, its timed steps so far
        self.warming = WARMUP_STEPS  # steps of the current block still left untimed
        self.rounds = 1  # rounds of trials begun
        self.predicting = None  # this rank's (codes, native) prediction the deciding step agrees
        self.prediction = None  # the agreed (codes, native) steps: the codes median and the model's native

    @property
    def trying(self) -> "str | None":
        """The policy the trial steps run now ("codes" or "native"), None outside the trials."""
        return TRIAL_ORDER[self.block] if self.phase == "trials" else None


class Schedule:
    """The chunk candidates, per bucket name the trials and the decision, and (policy="auto")
    the step trials between codes and the framework's own allreduce."""

    def __init__(self, candidates: tuple, auto: bool = False, link: "perf.Link | None" = None):
        if not candidates:
            raise ValueError("a schedule needs at least one candidate")
        self.candidates, self.auto, self.link = tuple(candidates), bool(auto), link
        self._buckets, self._lock = {}, threading.Lock()
        self._policy = _Policy() if auto else None
        self._watch = _Watch() if not auto and link is not None else None
        self._estimates = {}  # bucket name -> the model's seconds of the framework's allreduce of it

    @property
    def tuning(self) -> bool:
        """Whether there is a chunking to choose."""
        return len(self.candidates) > 1

    def _bucket(self, name: str) -> _Bucket:
        return self._buckets.setdefault(name, _Bucket(chosen=None if self.tuning else self.candidates[0]))

    # per exchange --------------------------------------------------------------------------------
    def candidate(self, name: str) -> int:
        """How this exchange of bucket `name` runs: NATIVE (the framework's own allreduce, no
        metadata), the chunking decided, else the next trial in order."""
        with self._lock:
            b = self._bucket(name)
            if b.chosen == NATIVE or self._native_now():
                return NATIVE
            if b.chosen is not None:
                return b.chosen
            if b.runs == 0:
                return self.candidates[0]  # the warm-up
            order = [c for _ in range(TRIALS) for c in self.candidates]
            return order[min(b.runs - 1, len(order) - 1)]

    def unchunked(self, name: str) -> None:
        """Bucket `name` has no chunking to choose (a reduce-scatter sends each row whole): it
        counts as decided, so policy="auto"'s step trials may start."""
        with self._lock:
            b = self._bucket(name)
            if b.chosen is None:
                b.chosen = 0

    def native(self, name: str) -> bool:
        """Whether this exchange of `name` goes through the framework's own allreduce."""
        return self.candidate(name) == NATIVE

    def decided(self, name: str) -> "int | None":
        with self._lock:
            return NATIVE if self._policy_native() else self._bucket(name).chosen

    def _native_now(self) -> bool:
        return self._policy is not None and (self._policy.trying == "native" or self._policy_native())

    def _policy_native(self) -> bool:
        return self._policy is not None and self._policy.chosen == "native"

    def entries(self, name: str) -> list:
        """This rank's timing entries for the metadata vector (ENTRIES of them, UNMEASURED where
        there is nothing to say: the vector has one length for every configuration, so a rank
        configured otherwise meets the signature check, not a shape error): the seconds and
        candidate of its last exchange of this bucket, and while policy="auto" decides, its
        median codes and native step."""
        with self._lock:
            last = self._bucket(name).last
            exchange = [UNMEASURED, UNMEASURED] if last is None else [last[1], float(last[0])]
            p = self._policy
            deciding = p is not None and p.phase == "deciding"
            if deciding and p.predicting is not None:
                steps = list(p.predicting)
            elif deciding:
                steps = [statistics.median(p.steps[k]) for k in ("codes", "native")]
            else:
                steps = [UNMEASURED, UNMEASURED]
        return exchange + steps

    @property
    def predicting(self) -> bool:
        """Whether exchanges should tell estimate_native() their size: policy="auto" with a link,
        before its prediction."""
        p, w = self._policy, self._watch
        if w is not None:
            return not w.done
        return p is not None and self.link is not None and p.prediction is None and p.phase in ("chunking", "trials")

    def estimate_native(self, name: str, nbytes: int, hosts: int, ranks_per_host: int) -> None:
        """The model's time of the framework's allreduce of bucket `name` (`nbytes` in the fallback
        dtype) on hosts x ranks_per_host ranks over the link."""
        seconds = perf.allreduce(nbytes, perf.Cluster(hosts, self.link, ranks_per_host))
        with self._lock:
            self._estimates[name] = seconds

    def measured(self, name: str, candidate: int, seconds: float) -> None:
        """This rank's wall time of an exchange of `name` that ran as `candidate`."""
        if self.tuning:
            with self._lock:
                self._bucket(name).last = (candidate, seconds)

    def agreed(self, name: str, entries) -> None:
        """The Max over ranks of the timing entries: the slowest rank's time of the last exchange,
        recorded at commit (a failed step records nothing); while policy="auto" decides, the
        slowest rank's median steps, which decide it (every exchange of that step carries the
        same, so whichever agrees first decides alike)."""
        seconds, candidate, codes, native = (float(v) for v in np.asarray(entries, np.float64))
        with self._lock:
            if self.tuning and seconds != UNMEASURED:
                self._bucket(name).pending = (int(candidate), seconds)
            if self._policy is not None and self._policy.phase == "deciding" and codes != UNMEASURED:
                self._policy.medians = (codes, native)  # decided at commit: a step's exchanges all run alike

    def _decide(self, codes: float, native: float) -> None:
        """policy="auto": every rank's slowest median steps -> another round of trials where they
        lie within CLEAR_MARGIN (the agreed medians are alike on every rank, so every rank goes on
        alike), else the policy for every bucket. Codes must beat the framework's own allreduce
        by CODES_MARGIN: within it the medians do not tell them apart, and the framework's own
        path is the one never slower than itself."""
        p = self._policy
        if p.predicting is not None:
            self._decide_predicted(codes, native)
            return
        if abs(codes - native) < CLEAR_MARGIN * native and p.rounds < ROUNDS:
            p.phase, p.block, p.timed, p.warming, p.medians = "trials", 0, 0, WARMUP_STEPS, None
            p.rounds += 1
            log.info("hvd_aps schedule: a close call (steps: codes %.1f ms, native allreduce %.1f ms): "
                     "trial round %d", 1e3 * codes, 1e3 * native, p.rounds)
            return
        native_wins = codes >= native * (1 - CODES_MARGIN)
        p.chosen, p.phase = ("native" if native_wins else "codes"), "decided"
        log.info("hvd_aps schedule: every bucket sends %s (steps: codes %.1f ms, native allreduce %.1f ms)",
                 "the framework's own allreduce" if native_wins else "codes", 1e3 * codes, 1e3 * native)

    def _decide_predicted(self, codes: float, native: float) -> None:
        """The agreed prediction -> the policy where one step is predicted PRIOR_MARGIN shorter,
        else the trial steps (a close call the model cannot settle)."""
        p = self._policy
        p.predicting, p.prediction, p.medians = None, (codes, native), None
        if abs(codes - native) <= PRIOR_MARGIN * min(codes, native):
            p.phase = "trials"  # on from the native block, the codes steps kept
            log.info("hvd_aps schedule: steps codes %.1f ms measured, native allreduce %.1f ms predicted: a close "
                     "call, timed", 1e3 * codes, 1e3 * native)
            return
        p.chosen, p.phase = ("native" if native < codes else "codes"), "decided"
        log.info("hvd_aps schedule: every bucket sends %s, as predicted without trials (steps: codes %.1f ms "
                 "measured, native allreduce %.1f ms predicted)",
                 "the framework's own allreduce" if p.chosen == "native" else "codes", 1e3 * codes, 1e3 * native)

    def _predict(self) -> bool:
        """policy="auto" with a link, the first block of codes steps timed: this rank's median
        codes step and the framework's step the model predicts from it, for the next step to
        agree -> whether there is a prediction (a link, every bucket's exchanges timed)."""
        p = self._policy
        codes = statistics.median(p.steps["codes"])
        native = self._predicted_native(codes) if self.predicting else None
        if native is None:
            return False
        p.predicting, p.phase = (codes, native), "deciding"
        return True

    def _predicted_native(self, codes: float) -> "float | None":
        """The framework's step the model predicts from a codes step of `codes` seconds: the codes
        exchanges' measured time taken out, its allreduce of every bucket over the link put in
        (None unless every bucket's exchanges were timed and estimated)."""
        buckets = self._buckets.values()
        if set(self._estimates) != set(self._buckets) or any(b.chosen not in b.times for b in buckets):
            return None
        exchanges = sum(statistics.median(b.times[b.chosen]) for b in buckets)
        return max(codes - exchanges, 0.0) + sum(self._estimates.values())

    def _watched(self, now: float) -> None:
        """policy="codes" with a link: a step committed; once the chunking is fixed and a block of
        steps timed (after WARMUP_STEPS), one warning where the framework's own step is predicted
        PRIOR_MARGIN shorter."""
        w = self._watch
        took, w.last = (None if w.last is None else now - w.last), now
        if w.done or took is None or not self._buckets or any(b.chosen is None for b in self._buckets.values()):
            return
        w.steps.append(took)
        if len(w.steps) < WARMUP_STEPS + BLOCK_STEPS:
            return
        w.done = True
        codes = statistics.median(w.steps[WARMUP_STEPS:])
        native = self._predicted_native(codes)
        if native is not None and native * (1 + PRIOR_MARGIN) < codes:
            log.warning("hvd_aps: codes steps take %.1f ms where the framework's own allreduce is predicted at %.1f "
                        "ms over the link HVD_APS_LINK gives: APSCompressor(..., policy='auto') sends the faster",
                        1e3 * codes, 1e3 * native)

    # steps ------------------------------------------------------------------------------------------
    def commit(self) -> None:
        with self._lock:
            for name, b in self._buckets.items():
                if b.pending is not None and b.chosen is None:
                    self._record(name, b, *b.pending)
                b.pending = None
            if self._policy is not None:
                self._step_ended(time.perf_counter())
            elif self._watch is not None:
                self._watched(time.perf_counter())

    def rollback(self) -> None:
        with self._lock:
            for b in self._buckets.values():
                b.pending = None
            if self._policy is not None:
                self._policy.last_commit = None  # the next step's time is not a clean measurement
                if self._policy.phase == "deciding":
                    self._policy.medians = None

    def _step_ended(self, now: float) -> None:
        """policy="auto": a step committed; its time counts for the trial block it ran in."""
        p = self._policy
        took, p.last_commit = (None if p.last_commit is None else now - p.last_commit), now
        if p.phase == "deciding" and p.medians is not None:
            self._decide(*p.medians)
            return
        if p.phase == "chunking" and self._buckets and all(b.chosen is not None for b in self._buckets.values()):
            p.phase = "trials"  # the first trial step starts here
            return
        if p.phase == "trials" and took is not None:
            log.debug("hvd_aps schedule: a %s step took %.1f ms%s", p.trying, 1e3 * took, " (warm-up)" if p.warming else "")
            if p.warming:
                p.warming -= 1
                return
            p.steps[p.trying].append(took)
            p.timed += 1
            if p.timed == BLOCK_STEPS:
                p.block, p.timed, p.warming = p.block + 1, 0, WARMUP_STEPS
                if p.block == len(TRIAL_ORDER):
                    p.phase = "deciding"
                elif TRIAL_ORDER[:p.block] == ("codes",):
                    self._predict()  # the first block timed codes: the model may settle it here

    def _record(self, name: str, b: _Bucket, candidate: int, seconds: float) -> None:
        b.runs += 1
        if b.runs > 1:  # the warm-up's time is not a trial
            b.times.setdefault(candidate, []).append(seconds)
        if all(len(b.times.get(c, ())) >= TRIALS for c in self.candidates):
            b.chosen = min(self.candidates, key=lambda c: (statistics.median(b.times[c]), self.candidates.index(c)))
            log.info("hvd_aps schedule: bucket %s runs %s (%s)", name, describe(b.chosen), _times_text(b.times))

    def reset(self) -> None:
        """Start over (the world changed: what was measured no longer holds)."""
        with self._lock:
            self._buckets.clear()
            self._estimates.clear()
            self._policy = _Policy() if self.auto else None
            self._watch = _Watch() if not self.auto and self.link is not None else None

    # reports and checkpoints -------------------------------------------------------------------------
    def report(self) -> list:
        """Per bucket: its name, the decision (None while trying) and the median seconds of every
        chunking tried, as dicts; with policy="auto" the policy's decision and its step medians."""
        with self._lock:
            rows = [{"bucket": name, "chosen": self._chosen_text(b),
                     "seconds": {describe(c): statistics.median(t) for c, t in b.times.items()}}
                    for name, b in self._buckets.items()]
            if self._policy is not None:
                p = self._policy
                seconds = {f"{k} step": statistics.median(v) for k, v in p.steps.items() if v}
                if p.prediction is not None:
                    seconds["native step (predicted)"] = p.prediction[1]
                rows.append({"bucket": "(policy: every bucket)", "chosen": p.chosen, "seconds": seconds})
            return rows

    def decisions(self) -> dict:
        """What was decided, in the names pin() takes: {"chunk_bytes": {bucket: float32 bytes a
        chunk, 0 unchunked}, "policy": "codes", "native" or None (still trying; only with
        policy="auto")}."""
        with self._lock:
            out = {"chunk_bytes": {name: b.chosen for name, b in self._buckets.items()
                                   if b.chosen is not None and b.chosen != NATIVE}}
            if self._policy is not None:
                out["policy"] = self._policy.chosen
            return out

    def pin(self, decisions: dict) -> None:
        """Take these decisions (decisions() of an earlier run) instead of trying: the buckets
        named run their chunking from the first exchange, and a policy pinned skips the trial
        steps. Every rank must pin the same, before the first step."""
        unknown = set(decisions) - {"chunk_bytes", "policy"}
        if unknown:
            raise ValueError(f"pin() takes 'chunk_bytes' and 'policy', got {sorted(unknown)}")
        chunks, policy = dict(decisions.get("chunk_bytes") or {}), decisions.get("policy")
        for name, value in chunks.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"chunk_bytes of {name!r} must be an int >= 0, got {value!r}")
        if policy not in (None, "codes", "native"):
            raise ValueError(f"policy must be 'codes', 'native' or None, got {policy!r}")
        if policy is not None and self._policy is None:
            raise ValueError("a policy is pinned only on a compressor made with policy='auto' (the others send codes)")
        with self._lock:
            for name, value in chunks.items():
                self._bucket(name).chosen = value
            if policy is not None:
                self._policy.chosen, self._policy.phase = policy, "decided"

    def _chosen_text(self, b: _Bucket):
        if self._policy_native():
            return describe(NATIVE)
        if self._policy is not None and self._policy.chosen is None and b.chosen is not None:
            return None  # the chunking is fixed, the policy not yet
        return None if b.chosen is None else describe(b.chosen)

    def state_dict(self) -> dict:
        with self._lock:
            state = {name: {"times": {str(c): list(t) for c, t in b.times.items()}, "runs": b.runs, "chosen": b.chosen}
                     for name, b in self._buckets.items()}
            if self._policy is not None:
                p = self._policy
                state["(policy)"] = {"phase": p.phase, "chosen": p.chosen, "block": p.block, "timed": p.timed,
                                     "rounds": p.rounds, "steps": {k: list(v) for k, v in p.steps.items()},
                                     "predicting": p.predicting, "prediction": p.prediction}
            return state

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            state = dict(state)
            policy = state.pop("(policy)", None)
            self._buckets = {name: _Bucket({int(c): list(t) for c, t in s["times"].items()}, s["runs"], s["chosen"])
                             for name, s in state.items()}
            if self._policy is not None and policy is not None:
                p = self._policy
                p.phase, p.chosen, p.block, p.timed = policy["phase"], policy["chosen"], policy.get("block", 0), policy.get("timed", 0)
                p.rounds = policy.get("rounds", 1)
                p.predicting, p.prediction = policy.get("predicting"), policy.get("prediction")
                p.steps = {k: list(v) for k, v in policy["steps"].items()}
                if p.phase == "trials":  # timing a step begun before the checkpoint
                    p.last_commit = None


def describe(candidate: int) -> str:
    if candidate == NATIVE:
        return "native allreduce"
    return "unchunked codes" if candidate == 0 else f"codes in {candidate >> 10} KiB chunks"


def _times_text(times: dict) -> str:
    return ", ".join(f"{describe(c)} {1e3 * statistics.median(t):.1f} ms" for c, t in times.items())
