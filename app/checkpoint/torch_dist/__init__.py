"""Megatron Core's distributed checkpoint (`--ckpt-format torch_dist`): `dcp_files` is PyTorch
DCP's files as Megatron Core lays them out, `per_rank` each rank's boxes (training: save and
load at any TP x PP x DP), `whole` the whole model in one process (conversion, inference)."""
