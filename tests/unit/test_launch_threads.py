"""The intra-op thread choice: the user's OMP_NUM_THREADS wins; otherwise the physical cores the
process may run on, shared by the ranks on its node, at least one each."""
import os

import torch

from app.launch.threads import apply_threads, choose_threads, physical_cores


def test_the_users_setting_wins():
    choice = choose_threads({"OMP_NUM_THREADS": "3"}, 8, cores=64)
    assert (choice.threads, choice.user_set) == (3, True)
    assert choice.describe() == "intra-op threads: 3 (OMP_NUM_THREADS=3)"
    odd = choose_threads({"OMP_NUM_THREADS": "4,2"}, 1, cores=64)  # OpenMP's nested syntax
    assert odd.user_set and odd.threads == torch.get_num_threads()
    assert "OMP_NUM_THREADS='4,2' is not a positive whole number" in odd.describe()


def test_cores_shared_by_the_ranks_on_the_node():
    assert choose_threads({}, 1, cores=16).threads == 16
    assert choose_threads({}, 8, cores=64).threads == 8
    assert choose_threads({}, 8, cores=4).threads == 1  # never zero
    assert choose_threads({}, None, cores=6).threads == 6  # unknown: one rank
    line = choose_threads({}, 2, cores=16).describe()
    assert line.startswith("intra-op threads: 8 (16 physical core(s) this process may run on / "
                           "2 ranks on this node; OMP_NUM_THREADS is not set")
    here = choose_threads({}, 1)
    assert here.threads == physical_cores(os.sched_getaffinity(0))


def test_hyperthreads_count_once():
    topology = {0: ("0", "0"), 1: ("0", "1"), 2: ("0", "0"), 3: ("0", "1"), 4: ("1", "0")}

    def read(path):
        cpu = int(path.split("/cpu")[-1].split("/")[0])
        return topology[cpu][0 if path.endswith("physical_package_id") else 1]

    assert physical_cores([0, 1, 2, 3, 4], read) == 3  # 2 cores x 2 threads + another package
    assert physical_cores([0, 2], read) == 1
    assert physical_cores([0, 1, 7], lambda path: None) == 3  # no topology: logical CPUs


def test_apply_sets_torch():
    before = torch.get_num_threads()
    try:
        apply_threads(choose_threads({"OMP_NUM_THREADS": "2"}, 1))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
