"""Process start-up and teardown for every launcher (torchrun, deepspeed, mpirun, plain python):
world discovery, the default process group and its timeout, rendezvous ports."""
