"""Training: the schedule, the optimizers and what training does with each cfg key."""
