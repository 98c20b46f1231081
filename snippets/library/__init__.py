"""The library versions of the parallelisms built from scratch in snippets/scratch/, under the
same names: scratch/pipeline.py <-> library/pipeline.py (torch.distributed.pipelining),
tensor_parallel.py (DTensor TP, and 2-D with FSDP2), sequence_parallel.py, context_parallel.py,
three_d.py (DeviceMesh + FSDP2 + TP + pipelining). Each is applied to the plain model, as
TorchTitan does. The trainer with Hugging Face Accelerate is here too: accelerate_train.py (the
tiny-GPT training of scripts/ddp_simulation_train.py, its distributed parts handed to an
Accelerator), accelerate_devices.py (where it puts the model and batches) and
accelerate_sharding.py (which examples each process loads). The rest live with the trainers that
use them: FSDP2 in training/fsdp_trainer.py, DDP in training/ddp_trainer.py, DeepSpeed in
cluster/deepspeed/.

Running a third-party trainer on the course's CPU machines: TorchTitan's Llama 3 debug model
under torchrun with gloo (torchtitan_cpu.py), on a tokenizer and corpus made offline by the
course's own code (torchtitan_assets.py). Both need the optional extra: `make torchtitan-env`."""
