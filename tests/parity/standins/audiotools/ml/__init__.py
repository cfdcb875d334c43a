import torch


class BaseModel(torch.nn.Module):
    INTERN = []
    EXTERN = []


class Accelerator:
    pass
