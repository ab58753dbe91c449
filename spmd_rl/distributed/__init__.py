"""Processes, pools and parallel layouts of one SPMD run.

``env`` reads the launcher's environment and starts torch.distributed; ``pools`` carves the world
into named rank ranges with their own process groups; ``dims`` holds the pure parallel layouts
(FSDP/HSDP, Ulysses, Megatron, rollout) and ``plan()``, the one validation run before any process
group exists; ``testing`` runs functions on N gloo CPU processes for tests.
"""
