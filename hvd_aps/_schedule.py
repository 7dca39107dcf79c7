"""How each bucket is exchanged, chosen at run time from measured times, alike on every rank.

Chunking: every candidate chunk size (0: the whole bucket) runs TRIALS timed steps, the least median
kept; chunking changes no bit (hvd_aps._layout). Whole steps are timed, not the exchange (buckets in
flight share the wire, threads and cores); each rank's time rides on the next metadata
Max-allreduce, so all decide alike on the slowest rank's. One step's buckets run one candidate.

policy="auto" then times codes steps against the framework's allreduce (NATIVE) in each dtype it may
send, in alternating blocks (WARMUP_STEPS untimed each), and decides at a commit for every bucket:
close medians (CLEAR_MARGIN) run more rounds (ROUNDS), a less exact path must be CODES_MARGIN
faster. Decisions live in state_dict, timed again after RECHECK_STEPS or sooner where codes steps
drift (DRIFT_WINDOW, DRIFT_MARGIN). Given a link (HVD_APS_LINK) the model (hvd_aps.perf) first drops
paths predicted PRIOR_MARGIN slower (a 16-bit prediction, a lower bound, only its own), and
policy="codes" warns where native is predicted PRIOR_MARGIN faster. Detail: docs/how-it-works.md.
"""
import collections
import copy
import dataclasses
import enum
import logging
import statistics
import threading
import time

import numpy as np

from . import perf
from .config import NATIVE_PATHS, Path

NATIVE = -1
CODES = Path.CODES
PATHS = tuple(Path)  # one timing entry each on the metadata vector, in this order
# predictions that bound a step from below only: the model leaves out 16-bit casts and sums
LOWER_BOUNDS = (Path.FLOAT16, Path.BFLOAT16)
ENTRIES = 2 + len(PATHS)  # timing entries on the metadata vector (Schedule.entries)
TRIALS = 2        # timed steps per chunking
BLOCKS = 2        # policy="auto"'s blocks of trial steps per path and round, alternating
BLOCK_STEPS = 3   # timed steps per block: STEP_TRIALS per path
STEP_TRIALS = BLOCK_STEPS * BLOCKS
WARMUP_STEPS = 1  # untimed steps at the start of each block
# the two fastest medians closer than this (a fraction of the slower) call for another round of trials
CLEAR_MARGIN = 0.15
ROUNDS = 3  # rounds of trials at most
# policy="auto" keeps a path over a more exact one only where its median step is this much
# shorter: the medians of six steps that vary by a quarter differ by about that much for equal paths
CODES_MARGIN = 0.05
# a path predicted slower than the fastest by more than this fraction of the fastest step is
# dropped without trial steps; set beyond the model's usual error (docs/performance-model.md), so
# that only clear calls skip the trials
PRIOR_MARGIN = 0.25
UNMEASURED = -1.0  # a timing entry with no measurement behind it
# policy="auto" times its paths again this many steps after each decision (a pinned one never): a
# link or a machine that changed since is noticed. Every rank counts the same commits, so every rank
# starts alike; a round where one path loses by a third costs about 0.3 % of the steps between.
RECHECK_STEPS = 1000
# codes kept: the median of each DRIFT_WINDOW codes steps against the first window's after the
# decision; a share of it this far away on any rank times every path again (medians of fifty
# steps move by a few percent where single steps move by a quarter; the first weighing comes a
# hundred steps after the decision, a tenth of RECHECK_STEPS). A re-check the drift started
# doubles the next window, up to MAX_DRIFT_WINDOW: the first window after a decision settles and
# the second is the first weighed, so a window of a quarter of RECHECK_STEPS still weighs twice
# before the re-check (one of half would close with it, and never weigh).
DRIFT_WINDOW = 50
DRIFT_MARGIN = 0.25
MAX_DRIFT_WINDOW = RECHECK_STEPS // 4
log = logging.getLogger("hvd_aps")


def trial_order(paths: tuple) -> tuple:
    """A round of trial blocks: every path in turn, BLOCKS times."""
    return tuple(paths) * BLOCKS


def trial_steps(paths: tuple) -> int:
    """The steps of a round of trials among `paths`, from the fixed chunking to its deciding step."""
    return len(trial_order(paths)) * (WARMUP_STEPS + BLOCK_STEPS) + 1


def max_trial_steps(natives: tuple = (Path.FLOAT32,)) -> int:
    """The steps policy="auto" may take to decide: every round of trials and its deciding step,
    and one more where a link's prediction could not settle it (its agreement takes a step of
    its own before the trials go on)."""
    return ROUNDS * trial_steps((CODES,) + tuple(natives)) + 1


class _Timeline:
    """Where a codes step's exchanges start after the step begins and how long the step goes on
    after the last one ends, over the last BLOCK_STEPS codes steps: the compute the model's
    allreduces are placed on (its backward handing over buckets, the optimizer and forward
    around them), measured in the job instead of taken from the codes step less its exchanges
    (which overlap the backward and each other: that took 60-75 % off the framework's step at 10
    Gbit/s on the netns cluster)."""

    def __init__(self):
        self.starts = {}  # bucket name -> its exchange's start after the step began, a deque a step
        self.tails = collections.deque(maxlen=BLOCK_STEPS)  # from the last exchange's end to the step's
        self.step = {}    # this step's bucket name -> (started, ended)

    def placed(self, name: str, started: float, ended: float) -> None:
        self.step[name] = (started, ended)

    def committed(self, began: "float | None", now: float, record: bool) -> None:
        """A step that began at `began` (None: not a clean measurement) ended at `now`; `record`:
        it ran codes at the fixed chunking."""
        if record and began is not None and self.step:
            for name, (started, _) in self.step.items():
                self.starts.setdefault(name, collections.deque(maxlen=BLOCK_STEPS)).append(started - began)
            self.tails.append(now - max(ended for _, ended in self.step.values()))
        self.step = {}

    def rolled_back(self) -> None:
        self.step = {}

    def step_with(self, exchanges: dict) -> "float | None":
        """The step where bucket `name`'s exchange takes exchanges[name] seconds from its start on
        this timeline, one after the other (None where a bucket has no start measured)."""
        if not self.tails or set(exchanges) - set(self.starts):
            return None
        starts = {name: statistics.median(self.starts[name]) for name in exchanges}
        free = 0.0
        for name in sorted(starts, key=starts.get):
            free = max(starts[name], free) + exchanges[name]
        return free + statistics.median(self.tails)


@dataclasses.dataclass
class _Watch:
    """policy="codes" with a link: this rank's steps once the chunking is fixed, for one prediction."""
    steps: list = dataclasses.field(default_factory=list)
    done: bool = False


@dataclasses.dataclass
class _Drift:
    """Codes kept by policy="auto": this rank's settled median step (the first `steps` codes
    steps after the decision), the window filling now, and its last median's share away from the
    settled one, either way (sent on the metadata; the agreed share, the most drifted rank's,
    re-checks)."""
    steps: int = DRIFT_WINDOW
    settled: "float | None" = None
    window: list = dataclasses.field(default_factory=list)
    latest: "float | None" = None
    share: "float | None" = None
    agreed: "float | None" = None  # the Max over ranks of `share`, agreed this step, applied at commit

    def add(self, took: float) -> None:
        self.window.append(took)
        if len(self.window) < self.steps:
            return
        median, self.window = statistics.median(self.window), []
        if self.settled is None:
            self.settled = median
        else:
            self.latest, self.share = median, abs(median / self.settled - 1)

    def state(self) -> dict:
        """What a checkpoint keeps (not `agreed`: a step's agreement ends with its commit)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "agreed"}

    @classmethod
    def load(cls, saved: dict) -> "_Drift":
        """A checkpoint's watch (its window at most MAX_DRIFT_WINDOW, as an earlier release's may not be)."""
        drift = cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})
        drift.steps = min(drift.steps, MAX_DRIFT_WINDOW)
        return drift


@dataclasses.dataclass
class _Bucket:
    times: dict = dataclasses.field(default_factory=dict)  # candidate -> agreed seconds of its trial steps
    chosen: int = None            # the decision, once made
    ran: int = None               # the candidate of this step's exchange
    before: int = None            # the candidate of the step before (None: no exchange then)
    last: tuple = None            # this rank's (candidate, seconds) of its last timed step, not yet sent
    pending: tuple = None         # (candidate, seconds) agreed this step, recorded at commit


class _Chunkings:
    """Per bucket name, the chunkings tried (TRIALS timed steps each, in turn) and the one chosen
    (the least median); the Schedule holds the lock."""

    def __init__(self, candidates: tuple):
        self.candidates, self.buckets = tuple(candidates), {}

    @property
    def tuning(self) -> bool:
        """Whether there is a chunking to choose."""
        return len(self.candidates) > 1

    @property
    def fixed(self) -> bool:
        """Every bucket seen has its chunking."""
        return bool(self.buckets) and all(b.chosen is not None for b in self.buckets.values())

    def bucket(self, name: str) -> _Bucket:
        return self.buckets.setdefault(name, _Bucket(chosen=None if self.tuning else self.candidates[0]))

    def candidate(self, name: str) -> int:
        """The chunking decided, else the candidate on trial."""
        b = self.bucket(name)
        if b.chosen is not None:
            return b.chosen
        return next((c for c in self.candidates if len(b.times.get(c, ())) < TRIALS), self.candidates[-1])

    def commit(self, took: "float | None") -> None:
        """A step ended after `took` seconds (None: not a clean measurement): each bucket's agreed
        time recorded, its own time kept to send where the step ran as the one before."""
        for name, b in self.buckets.items():
            if b.pending is not None and b.chosen is None:
                self._record(name, b, *b.pending)
            b.pending = None
            timed = b.ran is not None and b.ran == b.before and took is not None and b.chosen is None
            b.last = (b.ran, took) if timed else None  # a step like the one before it; sent next step
            b.before, b.ran = b.ran, None

    def rollback(self) -> None:
        for b in self.buckets.values():
            b.pending, b.ran, b.before = None, None, None

    def _record(self, name: str, b: _Bucket, candidate: int, seconds: float) -> None:
        b.times.setdefault(candidate, []).append(seconds)
        if all(len(b.times.get(c, ())) >= TRIALS for c in self.candidates):
            b.chosen = min(self.candidates, key=lambda c: (statistics.median(b.times[c]), self.candidates.index(c)))
            log.info("hvd_aps schedule: bucket %s runs %s (%s)", name, describe(b.chosen), _times_text(b.times))

    def pin(self, chunks: dict, undecided_only: bool) -> None:
        for name, value in chunks.items():
            if not undecided_only or self.bucket(name).chosen is None:
                self.bucket(name).chosen = value

    def state(self) -> dict:
        return {name: {"times": {str(c): list(t) for c, t in b.times.items()}, "chosen": b.chosen}
                for name, b in self.buckets.items()}

    def load(self, state: dict) -> None:
        self.buckets = {name: _Bucket({int(c): list(t) for c, t in s["times"].items()}, s["chosen"])
                        for name, s in state.items()}


class Phase(str, enum.Enum):
    """Where policy="auto" stands (its value is what a state_dict holds)."""
    CHUNKING = "chunking"  # the buckets' chunkings still tried: no policy trial yet
    TRIALS = "trials"      # blocks of trial steps on each path
    DECIDING = "deciding"  # the medians (or the model's prediction) ride on the next step's metadata
    DECIDED = "decided"    # every rank chose alike; no more trials for RECHECK_STEPS steps (or kept codes drift)


class _Policy:
    """policy="auto"'s step trials: blocks of steps on each path (codes, then the native dtypes
    in the order given: the more exact first), then the agreed decision."""

    def __init__(self, natives: tuple, drift_window: int = DRIFT_WINDOW):
        self.paths = (CODES,) + tuple(natives)  # Paths
        self.phase, self.chosen = Phase.CHUNKING, None  # chosen: a path
        self.steps = {path: [] for path in self.paths}  # this rank's timed steps on each path
        self.order = trial_order(self.paths)  # the blocks of the round under way
        self.medians = None  # the agreed {path: median step} behind the decision
        self.block, self.timed = 0, 0  # the trial block under way, its timed steps so far
        self.warming = WARMUP_STEPS  # steps of the current block still left untimed
        self.rounds = 1  # rounds of trials begun
        self.predicting = None  # this rank's {path: step}: the codes median, the model's natives
        self.prediction = None  # the agreed {path: step} of the prediction
        self.since = 0  # steps since the decision
        self.pinned = False  # decided by pin(): never timed again
        self.drift = _Drift(drift_window)  # codes kept: their steps since the decision

    @property
    def trying(self) -> "Path | None":
        """The path the trial steps run now, None outside the trials."""
        return self.order[self.block] if self.phase is Phase.TRIALS else None

    @property
    def native(self) -> "Path | None":
        """The native path this step sends every bucket on (a trial block's, or the decision),
        None where codes go."""
        path = self.trying or self.chosen
        return path if path is not None and path.native else None

    def weighing(self) -> tuple:
        """The paths this round's trials weigh, in preference order."""
        return tuple(path for path in self.paths if path in self.order)

    def entries(self) -> dict:
        """What this rank says on the metadata vector, by path: while deciding its median steps
        on the paths weighed (or its prediction); with codes kept, in the codes entry the share
        their steps drifted (a fraction, not seconds)."""
        if self.phase is Phase.DECIDING:
            return self.predicting or {k: statistics.median(self.steps[k]) for k in self.weighing()}
        if self.watching_drift and self.drift.share is not None:
            return {CODES: self.drift.share}
        return {}

    def agreed(self, medians: dict) -> None:
        """The slowest rank's entries, applied at commit alike on every rank: a decision's
        medians, or the most drifted rank's share."""
        if self.phase is Phase.DECIDING and medians:
            self.medians = medians  # decided at commit: a step's exchanges all run alike
        elif self.watching_drift and CODES in medians:
            self.drift.agreed = medians[CODES]

    def rolled_back(self) -> None:
        """A failed step: what its metadata agreed is not applied."""
        if self.phase is Phase.DECIDING:
            self.medians = None
        self.drift.agreed = None

    def report(self) -> dict:
        """Schedule.report()'s row of the policy."""
        medians = self.medians if self.phase is Phase.DECIDED and self.medians else {
            k: statistics.median(v) for k, v in self.steps.items() if v}
        seconds = {f"{_path_text(k)} step": v for k, v in medians.items()}
        seconds.update({f"{_path_text(k)} step (predicted)": v for k, v in (self.prediction or {}).items()
                        if k is not CODES})
        seconds.update({f"codes step ({when})": v for when, v in (("settled", self.drift.settled),
                                                                 ("latest", self.drift.latest)) if v is not None})
        chosen = None if self.chosen is None else _path_text(self.chosen)
        return {"bucket": "(policy: every bucket)", "chosen": chosen, "seconds": seconds}

    def decision(self) -> dict:
        """Schedule.decisions()'s policy entries, in the names pin() takes."""
        if self.chosen is None:
            return {"policy": None}
        if self.chosen.native:
            return {"policy": PinnedPolicy.NATIVE.value, "native_dtype": self.chosen.value}
        return {"policy": self.chosen.value}

    def load(self, saved: dict) -> None:
        """A state_dict()'s policy (its paths by name): "native" of an earlier release's fixed
        fallback read as the first native."""
        def path(name):
            return None if name is None else self.paths[1] if name == _OLD_NATIVE else Path(name)

        def paths(values):
            if values is None or isinstance(values, dict):
                return values if values is None else {path(k): v for k, v in values.items()}
            return dict(zip((CODES, self.paths[1]), values))  # an earlier release's (codes, native)

        self.phase, self.chosen = Phase(saved["phase"]), path(saved["chosen"])
        self.block, self.timed, self.rounds = saved.get("block", 0), saved.get("timed", 0), saved.get("rounds", 1)
        self.warming = saved.get("warming", WARMUP_STEPS)
        self.medians = paths(saved.get("medians"))  # saved only behind a decision (state())
        self.order = tuple(path(k) for k in saved.get("order", self.order))
        self.predicting, self.prediction = paths(saved.get("predicting")), paths(saved.get("prediction"))
        self.since, self.pinned = saved.get("since", 0), saved.get("pinned", False)
        self.drift = _Drift.load(saved.get("drift", {}))
        self.steps = {**{k: [] for k in self.paths}, **{path(k): list(v) for k, v in saved["steps"].items()}}

    def offers(self, saved: dict) -> bool:
        """Whether a state_dict()'s policy goes on sending only paths this one offers: its decision,
        or the trial blocks and prediction under way (a dtype this compressor's fallback does not
        send is not taken; steps timed on it before a decision are only reported)."""
        phase = Phase(saved["phase"])
        if phase is Phase.DECIDED:
            named = {saved["chosen"]}
        elif phase is Phase.CHUNKING:
            named = set()
        else:
            predicting = saved.get("predicting")
            named = {*saved.get("order", ()), *(predicting if isinstance(predicting, dict) else ())}
        return {Path(name) for name in named - {None, _OLD_NATIVE}} <= set(self.paths)

    def state(self) -> dict:
        """Plain values: paths by name."""
        return {"phase": self.phase.value, "chosen": _named(self.chosen), "block": self.block,
                "timed": self.timed, "warming": self.warming, "rounds": self.rounds,
                "order": [path.value for path in self.order],
                "medians": _by_name(self.medians) if self.phase is Phase.DECIDED else None,
                "steps": _by_name({k: list(v) for k, v in self.steps.items()}),
                "predicting": _by_name(self.predicting), "prediction": _by_name(self.prediction),
                "since": self.since, "pinned": self.pinned, "drift": self.drift.state()}


    # decisions ------------------------------------------------------------------------------------
    def step_ended(self, took: "float | None", chunking_fixed: bool, predict) -> None:
        """A step committed, having taken `took` seconds (None: not a clean measurement): its time
        counts for the trial block it ran in; `predict()` -> the model's {path: step} (or None)
        once the first block of codes steps is timed."""
        if self.phase is Phase.DECIDING and self.medians is not None:
            self.decide(self.medians)
            return
        if self.phase is Phase.DECIDED:
            self.since += 1
            if self.watching_drift and took is not None:
                self.drift.add(took)
            return
        if self.phase is Phase.CHUNKING and chunking_fixed:
            self.phase = Phase.TRIALS  # the first trial step starts here
            return
        if self.phase is not Phase.TRIALS or took is None:
            return
        log.debug("hvd_aps schedule: a %s step took %.1f ms%s", self.trying, 1e3 * took,
                  " (warm-up)" if self.warming else "")
        if self.warming:
            self.warming -= 1
            return
        self.steps[self.trying].append(took)
        self.timed += 1
        if self.timed == BLOCK_STEPS:
            self.block, self.timed, self.warming = self.block + 1, 0, WARMUP_STEPS
            if self.block == len(self.order):
                self.phase = Phase.DECIDING
            elif self.rounds == 1 and self.block == 1 and self.order[0] is CODES:
                natives = predict()  # the first block timed codes: the model may settle it here
                if natives is not None:
                    self.predicting = {CODES: statistics.median(self.steps[CODES]), **natives}
                    self.phase = Phase.DECIDING

    @property
    def watching_drift(self) -> bool:
        """Codes kept by trials or a prediction (not by pin()): their steps are watched for drift."""
        return self.phase is Phase.DECIDED and self.chosen is CODES and not self.pinned

    @property
    def recheck_due(self) -> bool:
        """RECHECK_STEPS steps since a decision pin() did not give, or codes kept whose steps
        drifted DRIFT_MARGIN on some rank: every path is to be weighed again as at the start."""
        return self.phase is Phase.DECIDED and not self.pinned and (self.since >= RECHECK_STEPS or self.drifted)

    @property
    def drifted(self) -> bool:
        """Some rank's kept codes steps moved DRIFT_MARGIN, agreed this step."""
        return (self.drift.agreed or 0.0) > DRIFT_MARGIN

    def decide(self, medians: dict) -> None:
        """Every rank's slowest median step on each path weighed -> another round of trials where
        the two fastest lie within CLEAR_MARGIN (the agreed medians are alike on every rank, so
        every rank goes on alike), else the path for every bucket: the fastest, unless a more
        exact path is within CODES_MARGIN of it (there the medians do not tell them apart, and the
        more exact path is never slower than itself)."""
        if self.predicting is not None:
            self.decide_predicted(medians)
            return
        first, second = sorted(medians.values())[:2]
        if second - first < CLEAR_MARGIN * second and self.rounds < ROUNDS:
            self.phase, self.order, self.block, self.timed, self.warming, self.medians = (
                Phase.TRIALS, trial_order(self.weighing()), 0, 0, WARMUP_STEPS, None)
            self.rounds += 1
            log.info("hvd_aps schedule: a close call (steps: %s): trial round %d", _steps_text(medians), self.rounds)
            return
        self.chosen = next(path for path in self.paths[1:] + (CODES,)
                           if path in medians and medians[path] * (1 - CODES_MARGIN) <= first)
        self.phase = Phase.DECIDED
        log.info("hvd_aps schedule: every bucket sends %s (steps: %s)", _path_text(self.chosen), _steps_text(medians))

    def decide_predicted(self, predicted: dict) -> None:
        """The agreed prediction -> the path where every other is predicted PRIOR_MARGIN slower
        than the fastest (a 16-bit prediction bounds its step from below: it drops only its own
        path), else trial steps among the paths left (a close call the model cannot settle)."""
        self.predicting, self.prediction, self.medians = None, dict(predicted), None
        fastest = min(v for path, v in predicted.items() if path not in LOWER_BOUNDS)
        left = tuple(path for path in self.paths if predicted[path] <= (1 + PRIOR_MARGIN) * fastest)
        if len(left) == 1:
            self.chosen, self.phase = left[0], Phase.DECIDED
            log.info("hvd_aps schedule: every bucket sends %s, as predicted without trials (steps: %s)",
                     _path_text(self.chosen), _steps_text(predicted))
            return
        order = list(trial_order(left))
        if CODES in order:
            order.remove(CODES)  # its first block is timed already: on from the native blocks
        self.phase, self.order, self.block, self.timed, self.warming = Phase.TRIALS, tuple(order), 0, 0, WARMUP_STEPS
        log.info("hvd_aps schedule: a close call the model cannot settle (steps: %s): timed", _steps_text(predicted))


class _Predictor:
    """The model's side of the schedule (a link given): each bucket's allreduce estimated over the
    link, the codes steps' timeline they are placed on, the framework's step predicted from both;
    with policy="codes", one warning where that step is predicted PRIOR_MARGIN shorter (_Watch)."""

    def __init__(self, link: "perf.Link | None", natives: tuple, watch: bool):
        self.link, self.natives = link, natives
        self.estimates = {}  # bucket name -> {native dtype: the model's seconds of its allreduce}
        self.timeline = _Timeline()
        self.watch = _Watch() if watch else None

    def estimate(self, name: str, elements: int, hosts: int, ranks_per_host: int) -> None:
        cluster = perf.Cluster(hosts, self.link, ranks_per_host)
        self.estimates[name] = {path: perf.allreduce(path.itemsize * elements, cluster) for path in self.natives}

    def natives_step(self, buckets) -> "dict | None":
        """The framework's step in each native dtype the model predicts: its allreduce of every
        bucket over the link on the codes steps' timeline (None unless every one of `buckets` was
        estimated and placed)."""
        if set(self.estimates) != set(buckets):
            return None
        predicted = {dtype: self.timeline.step_with({name: e[dtype] for name, e in self.estimates.items()})
                     for dtype in self.natives}
        return None if None in predicted.values() else predicted

    def watched(self, took: "float | None", buckets: dict) -> None:
        """policy="codes": a step committed; once the chunking is fixed and a block of steps timed
        (after WARMUP_STEPS), one warning where the framework's own step is predicted PRIOR_MARGIN
        shorter (in a dtype whose prediction is not only a lower bound)."""
        w = self.watch
        if w.done or took is None or not buckets or any(b.chosen is None for b in buckets.values()):
            return
        w.steps.append(took)
        if len(w.steps) < WARMUP_STEPS + BLOCK_STEPS:
            return
        w.done = True
        codes = statistics.median(w.steps[WARMUP_STEPS:])
        natives = self.natives_step(buckets) or {}
        native = min((v for dtype, v in natives.items() if dtype not in LOWER_BOUNDS), default=None)
        if native is not None and native * (1 + PRIOR_MARGIN) < codes:
            log.warning("hvd_aps: codes steps take %.1f ms where the framework's own allreduce is predicted at %.1f "
                        "ms over the link HVD_APS_LINK gives: APSCompressor(..., policy='auto') sends the faster",
                        1e3 * codes, 1e3 * native)


class Schedule:
    """The chunk candidates, per bucket name the trials and the decision, and (policy="auto")
    the step trials between codes and the framework's own allreduce in each of `natives`."""

    def __init__(self, candidates: tuple, auto: bool = False, link: "perf.Link | None" = None,
                 natives: tuple = (Path.FLOAT32,)):
        if not candidates:
            raise ValueError("a schedule needs at least one candidate")
        names = {p.value for p in NATIVE_PATHS}
        if not natives or any(str(n) not in names for n in natives):
            raise ValueError(f"natives must be some of {sorted(names)}, got {[str(n) for n in natives]}")
        self.auto, self.link = bool(auto), link
        self.natives = tuple(Path(str(n)) for n in natives)  # names parsed once
        self._chunkings, self._lock = _Chunkings(candidates), threading.Lock()
        self._began = None  # when this step began: the last commit (None: not a clean measurement)
        self._pins = []  # the decisions pin() was given: kept through reset() and under a load
        self._start()

    def _start(self) -> None:
        self._policy = _Policy(self.natives) if self.auto else None
        self._model = _Predictor(self.link, self.natives, watch=not self.auto and self.link is not None)

    @property
    def candidates(self) -> tuple:
        return self._chunkings.candidates

    @property
    def tuning(self) -> bool:
        """Whether there is a chunking to choose."""
        return self._chunkings.tuning

    # per exchange --------------------------------------------------------------------------------
    def candidate(self, name: str) -> int:
        """How this exchange of bucket `name` runs: NATIVE (the framework's own allreduce, no
        metadata), the chunking decided, else the candidate on trial (each TRIALS steps in turn)."""
        with self._lock:
            if self._policy is not None and self._policy.native is not None:
                self._chunkings.bucket(name)  # seen: the policy's step trials wait for its chunking
                return NATIVE
            return self._chunkings.candidate(name)

    def unchunked(self, name: str) -> None:
        """Bucket `name` has no chunking to choose (a reduce-scatter sends each row whole): it
        counts as decided, so policy="auto"'s step trials may start."""
        with self._lock:
            b = self._chunkings.bucket(name)
            if b.chosen is None:
                b.chosen = 0

    def native_dtype(self) -> "Path | None":
        """The native path every exchange of this step goes through (policy="auto": a trial
        block's or the decision; it changes only at a step's commit), None where codes go."""
        with self._lock:
            return None if self._policy is None else self._policy.native

    def _policy_native(self) -> bool:
        return self._policy is not None and self._policy.chosen is not None and self._policy.chosen.native

    def entries(self, name: str) -> list:
        """This rank's timing entries for the metadata vector (ENTRIES of them, UNMEASURED where
        there is nothing to say: the vector has one length for every configuration, so a rank
        configured otherwise meets the signature check, not a shape error): the seconds and
        candidate of the last step timed for this bucket, and while policy="auto" decides, its
        median step (or its prediction) on each path weighed, in PATHS' order; once it has kept
        codes, in the codes entry the share their steps drifted (a fraction, not seconds)."""
        with self._lock:
            last = self._chunkings.bucket(name).last
            exchange = [UNMEASURED, UNMEASURED] if last is None else [last[1], float(last[0])]
            steps = {} if self._policy is None else self._policy.entries()
        return exchange + [steps.get(path, UNMEASURED) for path in PATHS]

    @property
    def predicting(self) -> bool:
        """Whether exchanges should tell estimate_native() their size: policy="auto" with a link,
        before its prediction."""
        p, w = self._policy, self._model.watch
        if w is not None:
            return not w.done
        return (p is not None and self.link is not None and p.prediction is None
                and p.phase in (Phase.CHUNKING, Phase.TRIALS))

    def estimate_native(self, name: str, elements: int, hosts: int, ranks_per_host: int) -> None:
        """The model's time of the framework's allreduce of bucket `name` (`elements` of them) in
        each native dtype on hosts x ranks_per_host ranks over the link."""
        with self._lock:
            self._model.estimate(name, elements, hosts, ranks_per_host)

    def ran(self, name: str, candidate: int) -> None:
        """This step's exchange of `name` ran as `candidate`: the step's time counts for it."""
        if self.tuning:
            with self._lock:
                self._chunkings.bucket(name).ran = candidate

    def placed(self, name: str, started: float, ended: float) -> None:
        """While predicting: this step's exchange of `name` ran from `started` to `ended`
        (time.perf_counter(): from its hand-over to the driver to its results)."""
        with self._lock:
            self._model.timeline.placed(name, started, ended)

    def agreed(self, name: str, entries) -> None:
        """The Max over ranks of the timing entries: the slowest rank's time of the last timed step,
        recorded at commit (a failed step records nothing); while policy="auto" decides, the
        slowest rank's median steps, which decide it (every exchange of that step carries the
        same, so whichever agrees first decides alike); with codes kept, the most drifted rank's
        share, which re-checks at commit past DRIFT_MARGIN."""
        seconds, candidate, *steps = (float(v) for v in np.asarray(entries, np.float64))
        with self._lock:
            if self.tuning and seconds != UNMEASURED:
                self._chunkings.bucket(name).pending = (int(candidate), seconds)
            if self._policy is not None:
                self._policy.agreed({path: v for path, v in zip(PATHS, steps) if v != UNMEASURED})

    # steps ------------------------------------------------------------------------------------------
    def commit(self) -> None:
        with self._lock:
            now, began = time.perf_counter(), self._began
            took, self._began = (None if began is None else now - began), now
            self._chunkings.commit(took)
            fixed = self._chunkings.fixed
            ran_codes = self._policy is None or self._policy.native is None
            self._model.timeline.committed(began, now, self.predicting and fixed and ran_codes)
            if self._policy is not None:
                self._policy.step_ended(took, fixed, self._prediction)
                if self._policy.recheck_due:
                    self._recheck()
            elif self._model.watch is not None:
                self._model.watched(took, self._chunkings.buckets)

    def _recheck(self) -> None:
        """A fresh policy, as at the start: codes steps first (a bucket first met on a native path
        has its chunking tried there, and the deciding step's exchanges must carry metadata), then
        a round of trials (or, with a link, the model's prediction from the first block)."""
        p = self._policy
        if p.drifted and p.since < RECHECK_STEPS:
            log.info("hvd_aps schedule: codes steps moved %.0f %% on some rank since they settled: timing every "
                     "path again", 100 * p.drift.agreed)
            window = min(2 * p.drift.steps, MAX_DRIFT_WINDOW)
        else:
            log.info("hvd_aps schedule: %d steps since %s was chosen: timing every path again", p.since,
                     _path_text(p.chosen))
            window = DRIFT_WINDOW
        self._policy = _Policy(self.natives, window)

    def rollback(self) -> None:
        with self._lock:
            self._began = None  # the next step's time is not a clean measurement
            self._chunkings.rollback()
            self._model.timeline.rolled_back()
            if self._policy is not None:
                self._policy.rolled_back()

    def _prediction(self) -> "dict | None":
        """policy="auto" with a link, its first block of codes steps timed: the native steps the
        model predicts (None without a link, or before every bucket's exchanges were timed)."""
        return self._model.natives_step(self._chunkings.buckets) if self.predicting else None

    def reset(self) -> None:
        """Start over (the world changed: what was measured no longer holds; what pin() gave,
        measured nowhere, stays, as on a rank joining with the same pins)."""
        with self._lock:
            self._chunkings = _Chunkings(self.candidates)
            self._began = None
            self._start()
            for decisions in self._pins:
                self._apply_pins(decisions)

    # reports and checkpoints -------------------------------------------------------------------------
    def report(self) -> list:
        """Per bucket: its name, the decision (None while trying) and the median seconds of every
        chunking tried (agreed on every rank), as dicts; with policy="auto" the policy's decision
        ("codes", "native float32", ...) and its step medians on each path: the agreed ones (the
        slowest rank's, alike on every rank) behind a decision the trials made, this rank's own
        while they run; the model's, where it predicted; with codes kept this rank's own settled
        and latest medians."""
        with self._lock:
            rows = [{"bucket": name, "chosen": self._chosen_text(b),
                     "seconds": {describe(c): statistics.median(t) for c, t in b.times.items()}}
                    for name, b in self._chunkings.buckets.items()]
            if self._policy is not None:
                rows.append(self._policy.report())
            return rows

    def decisions(self) -> dict:
        """What was decided, in the names pin() takes: {"chunk_bytes": {bucket: float32 bytes a
        chunk, 0 unchunked}, "policy": "codes", "native" or None (still trying; only with
        policy="auto"), "native_dtype": the dtype of the framework's allreduce (policy "native")}."""
        with self._lock:
            out = {"chunk_bytes": {name: b.chosen for name, b in self._chunkings.buckets.items()
                                   if b.chosen is not None}}
            if self._policy is not None:
                out.update(self._policy.decision())
            return out

    def pin(self, decisions: dict) -> None:
        """Take these decisions (decisions() of an earlier run) instead of trying: the buckets
        named run their chunking from the first exchange, and a policy pinned skips the trial
        steps (a "native" one in "native_dtype", else the first of the natives). Every rank must
        pin the same, before the first step."""
        with self._lock:
            self._apply_pins(decisions)  # checked whole before anything changes
            self._pins.append(copy.deepcopy(decisions))

    @property
    def pins(self) -> list:
        """The decisions pin() was given, in order (they travel where the schedule is pickled)."""
        return list(self._pins)

    def _apply_pins(self, decisions: dict, undecided_only: bool = False) -> None:
        """Take pinned `decisions`, checked whole first (a bad one changes nothing);
        `undecided_only`: only where nothing is decided (a checkpoint loaded over the pins: what
        it decided stands)."""
        chunks, policy, dtype = _pinned(decisions, self.natives, self._policy is not None)
        self._chunkings.pin(chunks, undecided_only)
        if policy is not None and not (undecided_only and self._policy.phase is Phase.DECIDED):
            self._policy.chosen = dtype if policy is PinnedPolicy.NATIVE else CODES
            self._policy.phase, self._policy.pinned = Phase.DECIDED, True

    def _chosen_text(self, b: _Bucket):
        if self._policy_native():
            return describe(NATIVE)
        if self._policy is not None and self._policy.chosen is None and b.chosen is not None:
            return None  # the chunking is fixed, the policy not yet
        return None if b.chosen is None else describe(b.chosen)

    def state_dict(self) -> dict:
        with self._lock:
            state = self._chunkings.state()
            if self._policy is not None:
                state["(policy)"] = self._policy.state()
            return state

    def load_state_dict(self, state: dict, warn: bool = True) -> None:
        """A state_dict()'s measurements and decisions, loaded as a fresh process builds them; a
        policy sending a path this compressor does not offer is timed afresh (`warn`: say so);
        pin()'s decisions stand where the state decided nothing."""
        with self._lock:
            self._began = None  # timing a step begun before the checkpoint
            state = dict(state)
            saved = state.pop("(policy)", None)
            self._chunkings.load(state)
            self._start()
            if self._policy is not None and saved is not None:
                if self._policy.offers(saved):
                    self._policy.load(saved)
                elif warn:
                    log.warning("hvd_aps: the checkpoint's policy sends a path this compressor does not (its "
                                "fallback differs): every path is timed afresh")
            for decisions in self._pins:
                self._apply_pins(decisions, undecided_only=True)


class PinnedPolicy(str, enum.Enum):
    """What pin() and decisions() name a policy decision by."""
    CODES = "codes"
    NATIVE = "native"  # the framework's allreduce, in "native_dtype"


_OLD_NATIVE = PinnedPolicy.NATIVE.value  # an earlier release's state named its one native path so


def _named(path: "Path | None") -> "str | None":
    return None if path is None else path.value


def _by_name(paths: "dict | None") -> "dict | None":
    """{Path: value} -> {name: value}, as a state_dict keeps it."""
    return None if paths is None else {path.value: v for path, v in paths.items()}


def _pinned(decisions: dict, natives: tuple, auto: bool) -> tuple:
    """pin()'s decisions checked -> (chunk_bytes by bucket, the PinnedPolicy or None, the native Path)."""
    unknown = set(decisions) - {"chunk_bytes", "policy", "native_dtype"}
    if unknown:
        raise ValueError(f"pin() takes 'chunk_bytes', 'policy' and 'native_dtype', got {sorted(unknown)}")
    chunks, policy = dict(decisions.get("chunk_bytes") or {}), decisions.get("policy")
    dtype = decisions.get("native_dtype", natives[0])
    for name, value in chunks.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"chunk_bytes of {name!r} must be an int >= 0, got {value!r}")
    if policy is not None and policy not in {p.value for p in PinnedPolicy}:
        raise ValueError(f"policy must be 'codes', 'native' or None, got {policy!r}")
    if policy is not None and not auto:
        raise ValueError("a policy is pinned only on a compressor made with policy='auto' (the others send codes)")
    if dtype not in {n.value for n in natives}:
        raise ValueError(f"native_dtype must be one of this compressor's {[n.value for n in natives]} (its fallback), "
                         f"got {dtype!r}")
    return chunks, None if policy is None else PinnedPolicy(policy), Path(dtype)


def describe(candidate: int) -> str:
    if candidate == NATIVE:
        return "native allreduce"
    return "unchunked codes" if candidate == 0 else f"codes in {candidate >> 10} KiB chunks"


def _path_text(path: Path) -> str:
    return f"native {path}" if path.native else str(path)


def _steps_text(steps: dict) -> str:
    return ", ".join(f"{_path_text(path)} {1e3 * seconds:.1f} ms" for path, seconds in steps.items())


def _times_text(times: dict) -> str:
    return ", ".join(f"{describe(c)} {1e3 * statistics.median(t):.1f} ms" for c, t in times.items())
