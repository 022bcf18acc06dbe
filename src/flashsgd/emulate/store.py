"""The job's rendezvous store on an emulated cluster, hosted apart from the ranks (like torchrun's agent).

``python -m flashsgd.emulate.store HOST PORT`` runs a ``torch.distributed.TCPStore`` server in node
0's namespace until it is killed; the ranks run with ``TORCHELASTIC_USE_AGENT_STORE=True`` so every
rank, rank 0 included, is a client, as under torchrun. The store thus outlives every rank's
teardown, whichever rank finishes first.
"""

import datetime
import sys
import time

import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, None, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print("store ready", flush=True)
while True:  # killed by flashsgd.emulate.ranks.run_ranks when the job is over
    time.sleep(3600)
