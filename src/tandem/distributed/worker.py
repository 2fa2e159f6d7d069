"""`python -m tandem.distributed.worker`: one tensor-parallel rank other than 0, for multi-machine
runs. Set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK as for any torch.distributed job (and
LOCAL_RANK for the GPU on this machine); the model and flags come from rank 0."""

import logging

from tandem.distributed.launcher import worker_main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    worker_main()
