"""Worker of tests/test_trainer.py::test_sequence_parallel_matches_data_parallel (run under torchrun, 2 processes).

Two GRPO steps of the scripted-engine setup with `sequence_parallel_size` = argv[1]; rank 0 saves the parameters and
the logged history to argv[2].
"""

import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_trainer import AgenticGRPOTrainer, load_gptoss_tokenizer, scripted_trainer  # noqa: E402

sp_size, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
trainer, _ = scripted_trainer(
    out,
    load_gptoss_tokenizer(),
    cls=AgenticGRPOTrainer,
    max_steps=2,
    per_device_train_batch_size=4,
    sequence_parallel_size=sp_size,
    loss_type="grpo",  # normalised per sequence: exercises the x P loss scale of pooled SP batches
    router_aux_loss_coef=0.0,  # the load-balancing loss is computed per shard under SP (not comparable)
)
trainer.train()
if trainer.accelerator.is_main_process:
    torch.save(trainer.model.state_dict(), out / "params.pt")
    (out / "history.json").write_text(json.dumps(trainer.state.log_history))
trainer.accelerator.end_training()
# Skip interpreter finalization: a gloo worker thread can still be destroying a finished all_gather (whose tensors
# hold Python references) when finalization starts; it then cannot take the GIL and the rank aborts with
# "terminate called without an active exception" after all the work is done (seen ~1 in 16 runs on 2 cores, core
# dump: ~AsyncAllgatherWork in ProcessGroupGloo::runLoop while the main thread is in Py_FinalizeEx).  The results
# are written and flushed above, so exiting here loses nothing.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
