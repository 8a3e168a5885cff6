# Makes `import grpo` and `import common...` work from tests run anywhere under the repo root.
