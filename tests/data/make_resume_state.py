"""Writes a state and the results it resumes to, as a tree of hvd_aps makes them, for
tests/test_resume.py::test_a_state_saved_by_an_earlier_tree_resumes_on_its_bits:

    PYTHONPATH=<that tree> python tests/data/make_resume_state.py tests/data/resume_<commit>.pkl

4 steps of the codes exchange over 2 in-process ranks (e3m0, error feedback, stochastic
rounding; one bucket of 3 tensors); each rank's state_dict after step 2, and steps 3 and 4's
results. The test imports CASE from here, so the steps the file holds are the ones it reruns."""
import pickle
import sys

import numpy as np

STEPS, SAVED_AFTER = 4, 2


def compressors():
    import hvd_aps
    return [hvd_aps.APSCompressor("e3m0", error_feedback=True, rounding="stochastic", seed=7, chunk_bytes=0,
                                  min_elements=0) for _ in range(2)]


def grads(step):
    rng = np.random.default_rng(100 + step)
    return [[(rng.standard_normal(n) * 10.0 ** rng.uniform(-5, -1)).astype(np.float32) for n in (3000, 17, 5000)]
            for _ in range(2)]


def main(path):
    from hvd_aps import emulate
    comps, results = compressors(), []
    for step in range(STEPS):
        if step == SAVED_AFTER:
            saved = [c.state_dict() for c in comps]
        results.append([r.copy() for r in emulate.codes_allreduce(comps, grads(step))])
    with open(path, "wb") as f:
        pickle.dump({"states": saved, "results": results[SAVED_AFTER:]}, f)


if __name__ == "__main__":
    main(sys.argv[1])
