"""Worker of tests/test_fsdp2_trainer.py (run under `accelerate launch` with a CPU variant of
examples/accelerate/fsdp2.yaml, 2 processes).

Records what the launcher asked for (its FSDP environment variables), what accelerate set up on CPU
(`distributed_type`, FSDP2 or not) and what `AgenticGRPOTrainer` did with it: the error it raised, or, if it was
built, whether it saw FSDP. Each rank writes `rank{r}.json` to argv[1].
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_trainer import AgenticGRPOTrainer, load_gptoss_tokenizer, scripted_trainer  # noqa: E402

out = pathlib.Path(sys.argv[1])
launch_env = {k: v for k, v in os.environ.items() if k == "ACCELERATE_USE_FSDP" or k.startswith("FSDP_")}
record = {"launch_env": launch_env}
try:
    trainer, _ = scripted_trainer(out, load_gptoss_tokenizer(), cls=AgenticGRPOTrainer, max_steps=1)
    record["built"] = True
    record["is_fsdp_enabled"] = trainer.is_fsdp_enabled
except ValueError as exc:
    record["built"] = False
    record["error"] = str(exc)

from accelerate.state import PartialState  # noqa: E402  (set up by the trainer's accelerator above)

state = PartialState()
record.update(
    distributed_type=str(state.distributed_type),
    num_processes=state.num_processes,
    process_index=state.process_index,
    backend=state.backend,
)
(out / f"rank{state.process_index}.json").write_text(json.dumps(record))
state.wait_for_everyone()
# Skip interpreter finalization (as tests/trainer_sp_worker.py does): a gloo worker thread can still be tearing down
# a finished collective when it starts and abort the rank after all the work is done.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
