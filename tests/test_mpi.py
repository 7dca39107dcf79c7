"""Horovod's MPI controller, as clusters launch it: `horovodrun` without `--gloo` (it picks MPI
where Horovod was built with it) and plain `mpirun -np 2 python ...`. The README's blocks (the
one line for torch, hvd_aps.torch's optimizer, the TensorFlow tape, Keras 3; workers/readme_checks.py)
run under each launcher and must give the bits they give under Gloo: the exchange's collectives are
Horovod's, whichever controller carries them."""
import numpy as np
import pytest

from horovod_run import horovodrun, load, mpirun

try:
    from horovod.common import util as hvd_common
except ImportError:  # as horovod_run's launchers do: the MPI launches are features, not options
    pytest.fail("Horovod is not installed next to this Python: run scripts/install.sh", pytrace=False)
pytestmark = pytest.mark.skipif(not hvd_common.mpi_built(), reason="Horovod built without MPI (HVD_APS_MPI=none)")

LAUNCHES = {"gloo": lambda tmp, block: horovodrun("readme_checks.py", tmp, args=(block,)),
             "horovodrun-mpi": lambda tmp, block: horovodrun("readme_checks.py", tmp, args=(block,), gloo=False),
             "mpirun": lambda tmp, block: mpirun("readme_checks.py", tmp, args=(block,))}


@pytest.mark.parametrize("block", ["horovod-torch", pytest.param("horovod-tensorflow", marks=pytest.mark.slow)])
def test_mpi_launchers_give_the_bits_gloo_gives(block, tmp_path):
    results = {}
    for launcher, launch in LAUNCHES.items():
        out = tmp_path / launcher
        out.mkdir()
        launch(out, block)
        results[launcher] = load(out, f"readme_{block}")
    gloo = results.pop("gloo")
    assert not any(r["controller_mpi"] for r in gloo)
    for launcher, ranks in results.items():
        assert all(r["controller_mpi"] for r in ranks), f"{launcher}: Horovod did not run its MPI controller"
        for rank, (got, want) in enumerate(zip(ranks, gloo)):
            assert got.keys() == want.keys()
            for key in want.keys() - {"controller_mpi"}:
                np.testing.assert_array_equal(got[key].view(np.uint8), want[key].view(np.uint8),
                                              err_msg=f"{launcher} rank {rank}: {key}")
