"""Process start-up and teardown for every launcher (torchrun, deepspeed, mpirun, srun, plain
python): world discovery (slurm.py for srun tasks), the default process group and its timeout
(its keys per torchrun attempt), rendezvous ports, start-up waits that report themselves
(waits.py), NCCL diagnostics."""
