"""placeholder"""
def run_broadcast(device):
    return {"status": "skipped", "why": "not written yet"}
