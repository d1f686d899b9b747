def run(context):
    return {"agent": "four"}
