"""What is asked: the request record, the built-in retrieval tasks and their closed vocabulary.

Torch-free and below the contract (which validates ``builtin:<mix>`` sources against the tasks).
"""
