"""The time-to-accuracy benchmark's arithmetic (examples/time_to_accuracy.py): the time to a
target is the first evaluation that meets it, in the task's direction; a peer's median counts only
when more than half its seeds reached the target; with five or more seeds the fastest and the
slowest are dropped (MLPerf)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
import time_to_accuracy as tta  # noqa: E402

ACCURACY = tta.Task("acc", steps=3, global_batch=2, eval_every=1, target=0.9, higher_is_better=True, quality_name="a")
LOSS = tta.Task("loss", steps=3, global_batch=2, eval_every=1, target=2.0, higher_is_better=False, quality_name="l")


def run(times_and_qualities, tx=100.0):
    return {"log": [{"wall": w, "step": i + 1, "quality": q} for i, (w, q) in enumerate(times_and_qualities)],
            "tx_bytes_per_step": tx}


def test_time_to_target_follows_the_tasks_direction():
    log = run([(1.0, 0.5), (2.0, 0.91), (3.0, 0.85)])["log"]
    assert tta.time_to_target(ACCURACY, log) == 2.0
    assert tta.time_to_target(LOSS, run([(1.0, 2.5), (2.0, 2.1), (3.0, 1.99)])["log"]) == 3.0
    assert tta.time_to_target(LOSS, log) == 1.0  # 0.5 is a loss below 2.0: met at once
    assert tta.time_to_target(ACCURACY, run([(1.0, 0.5)])["log"]) is None


def test_a_median_needs_most_seeds_and_five_seeds_drop_the_extremes():
    reached, missed = run([(1.0, 0.5), (4.0, 0.95)]), run([(1.0, 0.5), (4.0, 0.6)])
    row = tta.summary(ACCURACY, [reached, missed])
    assert row["reached"] == "1/2" and row["tta_median"] is None and row["tta_min"] == 4.0
    five = [run([(t, 0.95)]) for t in (1.0, 2.0, 3.0, 4.0, 100.0)]
    row = tta.summary(ACCURACY, five)
    assert row["tta_median"] == 3.0 and (row["tta_min"], row["tta_max"]) == (2.0, 4.0)
    assert row["steps_per_s"] == 1 / 3.0 and row["bytes_per_step"] == 100.0
