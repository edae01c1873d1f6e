"""Stable Diffusion as a web app (Streamlit + diffusers), one replica per MPS slot of a shared GPU.

MODEL_ID picks the model (default stabilityai/sd-turbo: one inference step, about 5 GiB of GPU memory in fp16,
inside a 16Gi pinned-memory limit). With SD_STANDIN=cuda-probe it shows what the CUDA stand-in sees instead
(standin.py), without torch touching a GPU.
"""
from __future__ import annotations

import os

import streamlit as st
from standin import probe_report, standin_enabled

MODEL_ID = os.environ.get("MODEL_ID", "stabilityai/sd-turbo")
STEPS = int(os.environ.get("SD_STEPS", "1"))

st.set_page_config(page_title="Stable Diffusion on a shared GPU")
st.title("Stable Diffusion on an MPS slot")
st.caption(f"pod {os.environ.get('HOSTNAME', '?')}; GPU {os.environ.get('NVIDIA_VISIBLE_DEVICES', 'none')}; "
           f"threads {os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '100')} %; "
           f"pinned memory {os.environ.get('CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', 'unlimited')}")

if standin_enabled():
    st.subheader("CUDA stand-in")
    st.code("\n".join(probe_report()))
else:
    import torch
    from diffusers import AutoPipelineForText2Image

    @st.cache_resource
    def pipeline() -> AutoPipelineForText2Image:
        pipe = AutoPipelineForText2Image.from_pretrained(MODEL_ID, torch_dtype=torch.float16, variant="fp16")
        return pipe.to("cuda")

    prompt = st.text_input("Prompt", "a lighthouse on a cliff at dawn, oil painting")
    if st.button("Generate") and prompt:
        with st.spinner("generating"):
            image = pipeline()(prompt=prompt, num_inference_steps=STEPS, guidance_scale=0.0).images[0]
        st.image(image, caption=prompt)
