#!/bin/bash
# The figures and JSON tables of docs/sparse_accuracy.md from runs/sa/ (see runs.txt, queue.sh).
cd "$(dirname "$0")/../../.."
F=docs/data/sparse_accuracy/figures.py
P=.venv/bin/python
$P $F long 97 \
  "dense=L_dense_s1,L_dense_s2,L_dense_s3" \
  "gtopk 0.001=L_gtopk001_s1" \
  "gtopk 0.001 MC=L_gtopk001_mc_s1" \
  "gtopk 0.001 warm-up 4=L_gtopk001_w4_s1,L_gtopk001_w4_s2,L_gtopk001_w4_s3" \
  "gtopk 0.01 MC=L_gtopk01_mc_s1" \
  "topk 0.001 MC warm-up 4=L_topk001_mcw4_s1,L_topk001_mcw4_s2,L_topk001_mcw4_s3" \
  "topk 0.01=L_topk01_s1,L_topk01_s2,L_topk01_s3" \
  "powersgd rank 2=L_powersgd2_s1,L_powersgd2_s2,L_powersgd2_s3"
$P $F default 97 \
  "dense=D_dense_s1,D_dense_s2,D_dense_s3" \
  "gtopk 0.01=D_gtopk01_plain_s1,D_gtopk01_plain_s2,D_gtopk01_plain_s3" \
  "gtopk 0.01 layer_trust=D_gtopk01_lt_s1,D_gtopk01_lt_s2,D_gtopk01_lt_s3" \
  "gtopk 0.01 MC=D_gtopk01_mc_s1" \
  "gtopk 0.01 warm-up 4=D_gtopk01_w4_s1" \
  "gtopk 0.01 warm-up from dense, 8 epochs=D_gtopk01_wd8_s1" \
  "gtopk 0.1=D_gtopk1_plain_s1,D_gtopk1_plain_s2,D_gtopk1_plain_s3" \
  "powersgd rank 2=D_powersgd2_s1,D_powersgd2_s2,D_powersgd2_s3"
