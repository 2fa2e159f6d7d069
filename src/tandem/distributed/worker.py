"""`python -m tandem.distributed.worker`: one tensor-parallel rank other than 0. tandem starts it itself
for the ranks on this machine (distributed/rank_process.py); for multi-machine runs, start it on each
rank other than 0 with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set as for any torch.distributed
job (and LOCAL_RANK for the GPU on this machine). The model and flags come from rank 0."""

import logging
import os
import traceback

import torch

from tandem import envs
from tandem.distributed.launcher import TensorParallelError, worker_main


def main() -> None:
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    threads = envs.tp_num_threads()
    if threads:
        torch.set_num_threads(threads)  # as many as rank 0 uses
    try:
        worker_main()
    except TensorParallelError as e:
        logging.getLogger("tandem.distributed").error("%s; exiting", e)
        raise SystemExit(1) from None
    except BaseException:
        logging.getLogger("tandem.distributed").error("tensor-parallel rank %s failed:\n%s", rank,
                                                      traceback.format_exc())
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
