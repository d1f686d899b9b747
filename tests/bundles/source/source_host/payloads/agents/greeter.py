def run(context):
    return {"greeting": "hello"}
