"""Rank program for tests/test_launch.py: meet the other ranks in the launcher's store.

Every rank sets ``hello/<rank>``, waits for all of them and prints ``STORE {json}`` with the
values it read; then it tries a wrong token and prints ``WRONG_TOKEN refused <error type>``
(or ``WRONG_TOKEN accepted``).
"""

import json
import os

from gpucoll.errors import AuthenticationError, StoreError
from gpucoll.rendezvous.tcp_store import TCPStore

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
token = os.environ["GPUCOLL_AUTH_TOKEN"]

store = TCPStore(host, port, token=token, timeout=15)
store.set(f"hello/{rank}", f"from rank {rank}".encode())
arrived = store.add("arrived", 1)
store.wait([f"hello/{peer}" for peer in range(world_size)])
values = [store.get(f"hello/{peer}").decode() for peer in range(world_size)]
print("STORE " + json.dumps({"rank": rank, "values": values, "arrived": arrived}))

try:
    TCPStore(host, port, token=token + "-not-this-one", timeout=5).close()
except (AuthenticationError, StoreError) as exc:
    print(f"WRONG_TOKEN refused {type(exc).__name__}")
else:
    print("WRONG_TOKEN accepted")
store.barrier("done", world_size, timeout=15)
store.close()
