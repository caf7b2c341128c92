"""The training side: EpochCachedLoader and the memory-mapped ShardSetDataset it rebuilds each epoch (imports torch)."""
