from .strategy import DeepspeedStrategy, StrategyConfig

__all__ = ["DeepspeedStrategy", "StrategyConfig"]
