"""Post-training on the pretraining program: SFT data, rollouts, rewards, and the RL algorithm registry
(docs/post_training.md). The Loop drives it through `rl.RlStepper` (RL) or the pretraining stepper over
`data.SftData` (SFT)."""
