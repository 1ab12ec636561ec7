"""jaxrl_llm: JAX-native RL on verifiable rewards for LLM reasoning.

Subpackages are imported on demand so that `import jaxrl_llm.objectives` needs only jax and numpy.
"""

__version__ = "0.1.0"
