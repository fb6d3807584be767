"""One rank of the ``mpi`` test cluster: started by ``mpirun``, it makes a gpucoll communicator
with ``backend="mpi"``, connects back to the test process and runs the functions it is sent.

Usage (by tests/clusters.py): ``mpirun -n N python mpi_rank_server.py HOST:PORT AUTHKEY_HEX``.
Each task is ``(fn, args)``; the answer is ``("ok", fn(comm, *args))`` or ``("error",
traceback)``. A task that hangs dumps the stacks and exits (faulthandler), so mpirun ends.
"""

import faulthandler
import os
import sys
import traceback
from multiprocessing.connection import Client

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

HANG_SECONDS = 240.0


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(sys.argv[2]))
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        import gpucoll

        comm = gpucoll.init(backend="mpi", timeout=float(os.environ.get("GPUCOLL_TIMEOUT", "60")))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", comm.rank))
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args = task
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
        try:
            conn.send(("ok", fn(comm, *args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    faulthandler.cancel_dump_traceback_later()
    comm.close()


if __name__ == "__main__":
    main()
