"""Where samples come from: rollout engines, split placement, rewards, multi-turn episodes and tools."""
