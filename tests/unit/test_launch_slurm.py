"""Slurm's host lists and task counts, the world an srun task reads, the misuse refused, and
--exit-duration-in-mins from the job's end: hand-computed cases (no Slurm needed)."""
import pytest

from app.launch.distributed import cuda_device_index, world_from_environment
from app.launch.slurm import (SlurmLaunchError, exit_duration_from_end_time, expand_hostlist,
                              expand_tasks_per_node, job_port)


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("gpu[01-04,07],login1", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login1"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("a[008-010]", ["a008", "a009", "a010"]),
    ("n[1-2]-ib,x", ["n1-ib", "n2-ib", "x"]),
    ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
    ("c1,c[3-4],c2", ["c1", "c3", "c4", "c2"]),
    ("", []),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,why", [
    ("gpu[01-04", "not closed"), ("gpu01]", "without its"), ("gpu[4-1]", "backwards"),
    ("gpu[a-b]", "not a number"), ("g[[1]]", "nested"),
])
def test_expand_hostlist_refuses_what_is_not_slurms_syntax(text, why):
    with pytest.raises(ValueError, match=why):
        expand_hostlist(text)


def test_tasks_per_node_and_job_port():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("1,2(x2)") == [1, 2, 2]
    with pytest.raises(ValueError, match="N or N"):
        expand_tasks_per_node("2(3)")
    assert job_port(123) == 15123 and job_port(15000 + 7) == 15007 and job_port(0) == 15000


def step_env(**over):
    """Task 5 of a step of 8 tasks: two nodes gpu[01-02] with 4 tasks each; task 5 is local
    task 1 on gpu02 (node 1)."""
    env = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_NTASKS="8",
               SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_STEP_TASKS_PER_NODE="4(x2)",
               SLURM_STEP_NODELIST="gpu[01-02]", SLURM_JOB_NODELIST="gpu[01-03]",
               SLURMD_NODENAME="gpu02")
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_srun_task_world_and_exports():
    world = world_from_environment(step_env())
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == \
        (5, 8, 1, 4)
    assert world.exports == dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1",
                                 LOCAL_WORLD_SIZE="4", MASTER_ADDR="gpu01",
                                 MASTER_PORT=str(15000 + 4242))
    text = world.describe()
    assert text.startswith("rank 5 of 8 (local rank 1 of 4) from Slurm: SLURM_PROCID")
    assert "Slurm job 4242 step 0 on 2 node(s)" in text and "master gpu01:19242" in text
    # the step's node list wins over the job's; MASTER_PORT / MASTER_ADDR exported win
    world = world_from_environment(step_env(MASTER_PORT="6000", MASTER_ADDR="10.0.0.9"))
    assert world.exports["MASTER_ADDR"] == "10.0.0.9" and world.exports["MASTER_PORT"] == "6000"
    # uneven tasks: 3 on the first node, 1 on the second; a requeued job names its restart
    world = world_from_environment(step_env(SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_NTASKS="4",
                                            SLURM_PROCID="3", SLURM_LOCALID="0",
                                            SLURM_RESTART_COUNT="2"))
    assert (world.rank, world.world_size, world.local_world_size) == (3, 4, 1)
    assert "restart 2 (SLURM_RESTART_COUNT)" in world.describe()


def test_outside_a_step_is_a_world_of_one():
    assert world_from_environment({}).world_size == 1
    assert world_from_environment({}).warning is None
    batch = dict(SLURM_JOB_ID="7", SLURM_NTASKS="4", SLURM_PROCID="0")  # a batch script
    world = world_from_environment(batch)
    assert world.world_size == 1 and world.exports == {}
    assert "has 4 tasks (SLURM_NTASKS) but this process was not started by srun" in world.warning


def test_task_zero_must_run_on_the_first_node():
    with pytest.raises(SlurmLaunchError, match="task 0 runs on gpu02, not on the step's first"):
        world_from_environment(step_env(SLURM_PROCID="0", SLURM_LOCALID="0"))
    assert world_from_environment(step_env(SLURM_PROCID="0", SLURM_LOCALID="0",
                                           MASTER_ADDR="gpu02")).rank == 0


def test_launchers_inside_srun_tasks():
    torchrun = dict(TORCHELASTIC_RUN_ID="x", RANK="9", WORLD_SIZE="16", LOCAL_RANK="1",
                    LOCAL_WORLD_SIZE="8", GROUP_WORLD_SIZE="2")
    one_per_node = step_env(SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0",
                            SLURM_STEP_TASKS_PER_NODE="1(x2)", **torchrun)
    world = world_from_environment(one_per_node)
    assert (world.rank, world.world_size, world.local_world_size) == (9, 16, 8)
    assert world.source == "torchrun (one per node, Slurm job 4242 step 0)"
    assert world.exports == {}
    with pytest.raises(SlurmLaunchError, match=r"torchrun is running inside each of the 4 Slurm "
                                               r"tasks on gpu02 .*srun --ntasks-per-node=1"):
        world_from_environment(step_env(**torchrun))
    with pytest.raises(SlurmLaunchError, match=r"torchrun's rendezvous counts 1 node\(s\) but "
                                               r"srun started 2 tasks.*--nnodes \$SLURM_NNODES"):
        world_from_environment(dict(one_per_node, GROUP_WORLD_SIZE="1"))
    deepspeed = step_env(CROSS_SIZE="2", RANK="1", WORLD_SIZE="8", LOCAL_RANK="1")
    with pytest.raises(SlurmLaunchError, match="the deepspeed launcher is running inside each"):
        world_from_environment(deepspeed)


def test_exported_world_must_match_slurms():
    with pytest.raises(SlurmLaunchError, match=r"WORLD_SIZE=16 is exported but srun gives this "
                                               r"task SLURM_NTASKS=8: unset RANK"):
        world_from_environment(step_env(WORLD_SIZE="16"))
    with pytest.raises(SlurmLaunchError, match="RANK=0 is exported but srun gives this task "
                                               "SLURM_PROCID=5"):
        world_from_environment(step_env(RANK="0", WORLD_SIZE="8"))
    # a container hook exporting Slurm's own values is accepted
    world = world_from_environment(step_env(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1"))
    assert world.rank == 5 and "equal to Slurm's" in world.source


def test_exit_duration_from_the_jobs_end_time():
    job = dict(SLURM_JOB_ID="12", SLURM_JOB_END_TIME="10000")
    minutes, why = exit_duration_from_end_time(job, now=10000 - 240 * 60, margin_minutes=10)
    assert minutes == pytest.approx(230.0) and "240.0 minutes left in Slurm job 12" in why
    # 20 minutes left: the margin is 20% of them (4), not 10
    minutes, _ = exit_duration_from_end_time(job, now=10000 - 20 * 60, margin_minutes=10)
    assert minutes == pytest.approx(16.0)
    assert exit_duration_from_end_time({"SLURM_JOB_END_TIME": "10000"}, 0, 10) is None
    assert exit_duration_from_end_time({"SLURM_JOB_ID": "12"}, 0, 10) is None
    with pytest.raises(SlurmLaunchError, match="in the past"):
        exit_duration_from_end_time(job, now=10060, margin_minutes=10)


def test_exit_duration_derived_in_the_run_config(monkeypatch):
    import time
    from arguments import config_from_argv
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "5"]
    monkeypatch.setenv("SLURM_JOB_ID", "3")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 3600))
    t = config_from_argv(argv, 1, 512).training
    assert 49.9 < t.exit_duration_in_mins <= 50.0 and "Slurm job 3" in t.exit_duration_source
    t = config_from_argv(argv + ["--exit-duration-in-mins", "7"], 1, 512).training
    assert t.exit_duration_in_mins == 7 and t.exit_duration_source is None


def test_cuda_device_of_a_rank():
    assert cuda_device_index(3, 8, 8) == 3
    assert cuda_device_index(3, 4, 1) == 0  # srun --gpus-per-task=1: one GPU per task
    with pytest.raises(ValueError, match="local rank 5 .* has no GPU: this process sees 4"):
        cuda_device_index(5, 8, 4)


def test_layout_message_names_where_the_world_came_from():
    from arguments import config_from_argv, parse_args, build_run_config
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "32", "--max-position-embeddings", "32",
                       "--train-iters", "5", "--tensor-model-parallel-size", "2"])
    source = world_from_environment(step_env(SLURM_NTASKS="3", SLURM_STEP_TASKS_PER_NODE="3",
                                             SLURM_PROCID="1", SLURM_NODEID="0")).source
    with pytest.raises(ValueError, match=r"world size \(3\) is not divisible .* \(the world "
                                         r"size came from Slurm: SLURM_PROCID, SLURM_NTASKS "
                                         r"\(srun --ntasks\)"):
        build_run_config(args, 3, 512, world_source=source)
    assert config_from_argv(["--train-iters", "1"], 2, 512).parallel.world_source == ""
