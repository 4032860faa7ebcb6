"""Plan and apply a plan where users train: one module per framework, each an optional extra.

    from planner.integrations.hf import plan_trainer              # transformers.Trainer
    from planner.integrations.lightning import SACPlanCallback     # lightning.pytorch.Trainer
    from planner.integrations.torchtitan import PlannedAC          # torchtitan's AC config

Each reads the training step from the framework (optimizer, micro-batches, mixed precision, the
batch, the loss, what the loop keeps beside it), never from the user, plans it and applies the
plan at the framework's own hook. What a framework's step does that the planner does not model
(gradient clipping, a learning-rate scheduler) is said in the plan's notes. Importing this
package imports no framework; each module imports its own when it is imported.
"""
