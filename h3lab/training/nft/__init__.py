"""`h3lab.training.nft`: DiffusionNFT (arXiv 2509.16117) on H3 beside GRPO -- online RL on the forward process:
rollouts with any sampler (the released Euler ODE included), no likelihoods, no CFG; the rewards' group advantages
split each sample between an implicit positive and an implicit negative policy around the frozen previous policy,
trained by flow matching on forward-noised final latents.

- `objective.py`  `NftConfig`, `optimality`, `nft_modality_loss`, `noising_seed` (the math and the draw order)
- `step.py`       `CleanRequest`, `NftBatch`, `batch_from_rollout`, `noised_items`, `frozen_velocities`,
                  `nft_iteration` (v_old, the loss, the inner epochs; the refresh schedule)
- `run.py`        sealed runs: `nft_train` (resume), `load`, `verify`
- `job.py`        `h3lab train nft` jobs (`NftJob`: `GrpoJob`'s folder, checks and resume, with `NftConfig`)

    from h3lab.training.nft import NftConfig, batch_from_rollout, nft_train, verify
    config = NftConfig(kind="euler", group=4, beta=1.0, ref_kl=1e-4, mode="strict")
    run = nft_train(model, lambda k, m: batch_from_rollout(session.rollout(..., stepper="euler",
                    needs_density=False), rewards), config, iterations=10)
"""

from .objective import NftConfig, nft_modality_loss, noising_seed, optimality
from .run import NftRun, load, nft_train, verify
from .step import CleanRequest, NftBatch, batch_from_rollout, clean_request, frozen_velocities, nft_iteration
from .job import NftJob, run_nft_job

__all__ = ["NftConfig", "nft_modality_loss", "noising_seed", "optimality", "NftRun", "load", "nft_train", "verify",
           "CleanRequest", "NftBatch", "batch_from_rollout", "clean_request", "frozen_velocities", "nft_iteration",
           "NftJob", "run_nft_job"]
